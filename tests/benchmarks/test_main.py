"""One runner for every benchmark: ``python -m benchmarks NAME [flags]`` from the repository root."""

import importlib
import subprocess
import sys

import pytest

from benchmarks import child_env
from benchmarks.__main__ import COMMANDS, main

from ..support import ROOT


def test_without_a_name_it_lists_every_benchmark(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m benchmarks NAME [flags]")
    assert all(f"  {name} " in err for name in COMMANDS)
    assert main(["-h"]) == 0
    assert capsys.readouterr().out == err  # asked for: the same list on stdout, exit 0


def test_an_unknown_name_is_one_line_and_exit_2(capsys):
    assert main(["scoreboard"]) == 2
    err = capsys.readouterr().err
    assert err == "python -m benchmarks: no benchmark named 'scoreboard'; choose from " + ", ".join(COMMANDS) + "\n"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_name_runs_a_module_main_with_its_own_flags(name, capsys):
    """Each name's module takes its flags through ``main(argv)``, its usage under the runner's spelling."""
    assert callable(importlib.import_module(f"benchmarks.{COMMANDS[name][0]}").main)
    with pytest.raises(SystemExit) as exit_:
        main([name, "--no-such-flag"])
    assert exit_.value.code == 2
    assert f"usage: python -m benchmarks {name}" in capsys.readouterr().err


def test_a_benchmark_runs_from_the_repository_root():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "prefetch_paper"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| model, series | device |") and "\nsources: " in done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["offload", "--json", "no/such/dir/x.json"],
        ["weight_sync", "--quick", "--json=no/such/dir/x.json"],
        ["planner_map", "--markdown", "no/such/dir/map.md"],
    ],
)
def test_an_output_file_without_its_folder_is_refused_before_anything_runs(argv, capsys):
    """A benchmark of minutes must not measure, then fail to write: the runner checks every output flag first."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    flag = argv[-1].partition("=")[0] if "=" in argv[-1] else argv[-2]
    assert err.startswith(f"python -m benchmarks {argv[0]}: {flag} no/such/dir/")
    assert "no directory 'no/such/dir' to write it in" in err and err.count("\n") == 1


def test_output_flags_whose_folder_exists_pass_the_check(tmp_path):
    from benchmarks.__main__ import missing_folder

    assert missing_folder(["--json", str(tmp_path / "x.json"), "--markdown=" + str(tmp_path / "m.md")]) is None
    assert missing_folder(["--quick", "--rounds", "3"]) is None
    assert missing_folder(["--json"]) is None  # no value: the benchmark's own parser says so


def test_a_quick_weight_sync_never_replaces_the_published_results():
    from benchmarks.bench_weight_sync import PUBLISHED, output_path

    assert output_path(None, quick=True) is None
    assert str(output_path(None, quick=False)) == PUBLISHED
    assert str(output_path("mine.json", quick=True)) == "mine.json"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["offload", "--repeat", "0"], "argument --repeat: expected a positive integer, got 0"),
        (["offload", "--latency-us", "-5"], "argument --latency-us: expected a finite number >= 0, got '-5'"),
        (["planner_serve", "--budgets", "0"], "argument --budgets: expected comma-separated positive numbers, got '0'"),
        (["module_tp", "--rounds", "x"], "argument --rounds: expected a positive integer, got 'x'"),
    ],
)
def test_a_bad_count_or_figure_is_refused_by_argparse_before_any_work(argv, message, capsys):
    """Once each failed after minutes of compiling and measuring, with a traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
