"""``plan`` and ``generate --plan auto | FILE`` on the command line: the ranked table and the chosen plan, the
planner's choice run against transformers, and plan files for another model or mesh refused by name."""

import json
import os
import stat
from decimal import Decimal

import pytest

from functional_npu import Plan
from functional_npu.cli.main import main

from ..support.cli import refused
from ..support.hf_models import hf_greedy, save_tiny, save_tiny_moe

PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_plan")
    hf = save_tiny("qwen3", path, 7)
    return path, [hf_greedy(hf, p, 4) for p in PROMPTS]


def test_plan_prints_the_ranked_table_and_writes_the_chosen_plan(qwen3, tmp_path, capsys):
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--model", str(qwen3[0]), "--devices", "4", "--device", "910b", "--memory-gb", "1"]
    assert main(argv + ["--batch", "8", "--context", "64", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM on 4 x ascend-910b (1.00 GB each), decode, batch 8, context 64" in out
    assert "| 1 | " in out and "chosen: " in out
    written = json.loads(out_file.read_text())
    assert written["model"] == "Qwen3ForCausalLM" and written["plan"]["model"] == "Qwen3ForCausalLM"
    assert sum(1 for _ in written["axes"]) >= 2
    assert main(argv + ["--prefill", "128", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "prefill of 128 tokens" and report["candidates"][0]["fits"]


def test_generate_runs_the_planners_choice_with_transformers_tokens(qwen3, tmp_path):
    """--plan auto on 2 ranks: this machine is measured (2 gloo ranks, cached under FUNCTIONAL_NPU_CACHE), the
    chosen plan runs, and its tokens are transformers'."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "functional_npu", "generate", "--model", str(qwen3[0]), "--plan", "auto"]
    argv += ["--devices", "2", "--backend", "none", "--max-new-tokens", "4", "--json"]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    env = os.environ | {"FUNCTIONAL_NPU_CACHE": str(tmp_path)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] == qwen3[1]
    assert out.stderr.startswith("plan: ") and "sequences at once" in out.stderr  # the run's prompts, served
    check = result["plan_check"]  # the choice checks itself: its decode step measured against the prediction
    assert check["predicted_decode_ms"] > 0 and check["measured_decode_ms"] > 0 and check["term"]
    assert check["error"] == pytest.approx(check["measured_decode_ms"] / check["predicted_decode_ms"] - 1)
    warned = [ln for ln in out.stderr.splitlines() if ln.startswith("warning: plan check:")]
    assert len(warned) == (abs(check["error"]) > check["tolerance"])
    assert list((tmp_path / "host-profile").glob("*world2.json"))  # measured once, kept for the next run


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dp", "2"], "--plan auto sets the mesh and the plan; drop --dp"),
        (["--layer-shard", "o_proj", "--otp", "1"], "--plan auto sets the mesh and the plan; drop --layer-shard"),
    ],
)
def test_plan_flags_that_conflict_are_refused(qwen3, extra, message, capsys):
    refused(
        ["generate", "--model", str(qwen3[0]), "--plan", "auto", *extra, "--prompt-ids", "1", "--max-new-tokens", "2"],
        message,
        capsys,
    )


def test_a_plan_file_for_another_model_or_mesh_is_refused_by_name(qwen3, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert (
        main(
            ["plan", "--model", str(qwen3[0]), "--devices", "2", "--device", "h100", "--context", "32"]
            + ["--out", str(plan_file)]
        )
        == 0
    )
    capsys.readouterr()
    moe = tmp_path / "moe"
    save_tiny_moe("qwen3_moe", moe, 1)
    gen = ["--prompt-ids", "1", "--max-new-tokens", "2"]
    refused(
        ["generate", "--model", str(moe), "--plan", str(plan_file), *gen],
        f"--plan {plan_file}: the plan was made for Qwen3ForCausalLM, but this model is a Qwen3MoeForCausalLM",
        capsys,
    )
    refused(
        ["generate", "--model", str(qwen3[0]), "--plan", str(plan_file), "--devices", "4", *gen],
        f"--plan {plan_file}: the plan is for 2 devices",
        capsys,
    )
    (tmp_path / "bad.json").write_text("{nope")
    refused(["generate", "--model", str(qwen3[0]), "--plan", str(tmp_path / "bad.json"), *gen], "not JSON", capsys)
    (tmp_path / "latin1.json").write_bytes(b'{"model": "caf\xe9"}')  # once Python's decode error, no file named
    refused(
        ["generate", "--model", str(qwen3[0]), "--plan", str(tmp_path / "latin1.json"), *gen],
        f"--plan {tmp_path / 'latin1.json'}: not UTF-8 text (byte 14: b'\\xe9'): a plan file is JSON",
        capsys,
    )
    extra = json.loads(plan_file.read_text()) | {"axes": {"dp": 1, "tp": 1, "pp": 2}}
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    refused(  # once: a second rank started that ran nothing the plan named
        ["generate", "--model", str(qwen3[0]), "--plan", str(tmp_path / "extra.json"), *gen],
        f"--plan {tmp_path / 'extra.json'}: mesh axis 'pp' of size 2 is used by nothing in the plan (tensor parallel "
        "over 'tp', data parallel over 'dp'), yet it would start 2x the ranks; drop it, or name it 'dp' to run 2 "
        "data-parallel replicas",
        capsys,
    )
    budget = json.loads(plan_file.read_text())
    budget["axes"] = {"dp": 2, "tp": 1}
    budget["plan"] |= {"tp": "tp", "layer_shard": "o_proj", "prefetch_step": "auto", "prefetch_budget": 10}
    (tmp_path / "budget.json").write_text(json.dumps(budget))
    refused(  # before any rank starts (before: after the checkpoint had loaded)
        ["generate", "--model", str(qwen3[0]), "--plan", str(tmp_path / "budget.json"), "--dtype", "bfloat16", *gen],
        f"--plan {tmp_path / 'budget.json'}: prefetch_step='auto': the prefetch ring budget of 10 bytes does not hold "
        "one layer of o_proj (",
        capsys,
    )
    refused(  # without --dtype: the stored dtype's bytes (once: past this check, refused by every rank)
        ["generate", "--model", str(qwen3[0]), "--plan", str(tmp_path / "budget.json"), *gen],
        f"--plan {tmp_path / 'budget.json'}: prefetch_step='auto': the prefetch ring budget of 10 bytes does not hold "
        "one layer of o_proj (",
        capsys,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "tpu"], "device 'tpu' is not known; choose one of ascend-910b"),
        (["--device", "910b", "--memory-gb", "0.0001"], "the smallest need is"),
        (["--devices", "1000000"], "--devices 1000000: the planner weighs at most 1024 devices"),  # once never returned
        (["--memory-gb", "inf"], "argument --memory-gb: expected a finite number of gigabytes, got inf"),
        (["--context", "300"], "--context 300: the step needs 301 positions, past the model's 256"),
        (["--out", "/nonexistent/dir/plan.json"], "--out /nonexistent/dir/plan.json: the directory /nonexistent/dir"),
        (["--out", "/tmp"], "--out /tmp: is a directory; give a file path such as /tmp/plan.json"),
        (["--out", ""], "--out: expected the path of the plan file to write, got ''"),
        (["--memory-gb", "1e300"], "--memory-gb 1e+300: outside [1e-09, 1e+09] GB (a byte to an exabyte per device)"),
        (["--memory-gb", "1e-300"], "--memory-gb 1e-300: outside [1e-09, 1e+09] GB"),  # once: "states no memory"

    ],
)  # fmt: skip
def test_bad_plan_arguments_are_one_line(qwen3, args, message, capsys):
    """Exit 2 with one line, before anything is printed or measured (an --out that cannot be written once came after
    the report, as a traceback)."""
    argv = ["plan", "--model", str(qwen3[0]), "--devices", "2", "--context", "64", *args]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and message in captured.err and captured.out == ""
    assert len([ln for ln in captured.err.strip().splitlines() if "error" in ln]) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--serve", "1"], "workload: a served sequence of context 1 has no room for a prompt token and a "),
        (["--serve", "64", "--prompt-share", "0.001"], "workload: a prompt share of 0.001 rounds to no prompt token in "
         "a context of 64; give at least 0.0156 (one token), or 0 for decode alone"),
        (["--serve", "64", "--memory-gb", "1e300"], "--memory-gb 1e+300: outside [1e-09, 1e+09] GB"),  # an overflow
    ],
)  # fmt: skip
def test_bad_serving_plan_arguments_are_one_line(qwen3, args, message, capsys):
    """Once: an internal error blamed on every candidate, a silent decode-alone plan, a 42-line OverflowError."""
    try:
        code = main(["plan", "--model", str(qwen3[0]), "--devices", "2", *args])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and message in captured.err and captured.out == ""
    assert len(captured.err.strip().splitlines()) <= 2  # argparse's usage line, then the error


def test_plan_out_never_replaces_what_is_not_a_regular_file(qwen3, tmp_path, capsys):
    """``--out`` a FIFO (or, as root, a device node made for the test): refused before anything is planned, the entry
    left as it was (the atomic write once turned them, and /dev/null, into regular files holding the plan)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    targets = {fifo: "a FIFO"}
    if os.geteuid() == 0:
        node = tmp_path / "null"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        targets[node] = "a character device"
    for path, kind in targets.items():
        before = os.lstat(path).st_mode
        try:
            code = main(["plan", "--model", str(qwen3[0]), "--devices", "2", "--context", "64", "--out", str(path)])
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        assert code == 2 and captured.out == ""
        assert f"--out {path}: {path} is {kind}, not a regular file" in captured.err
        assert os.lstat(path).st_mode == before


def test_plan_serve_ranks_by_tokens_per_device_and_a_refused_figure_is_accepted_given_back(qwen3, capsys):
    argv = ["plan", "--model", str(qwen3[0]), "--devices", "4", "--device", "910b", "--serve", "64"]
    assert main(argv + ["--prompt-share", "0.25", "--max-seqs", "16", "--memory-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "serving, context 64, 25% prompt tokens, at most 16 sequences" in out
    assert "| rank | plan | batch | tok/s/device | step ms |" in out and "sequences at once" in out
    assert main(argv + ["--memory-gb", "0.00001"]) == 2
    err = capsys.readouterr().err
    figure = err.split("the smallest need is ")[1].split(" per device")[0]
    number, unit = figure.split(" ")
    gb = Decimal(number) * {"GB": 1, "MB": Decimal("1e-3"), "kB": Decimal("1e-6"), "B": Decimal("1e-9")}[unit]
    assert main(argv + ["--memory-gb", str(gb), "--json"]) == 0  # exactly the figure named
    assert json.loads(capsys.readouterr().out)["candidates"][0]["batch"] >= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--serve", "64", "--prompt-share", "1.5"], "--prompt-share 1.5: the share of tokens that are prompt tokens"),
        (["--serve", "64", "--prompt-share", "nan"], "--prompt-share nan: the share"),
        (["--serve", "4", "--prompt-share", "0.9"], "--prompt-share 0.9: leaves no generated token in a context of 4"),
        (["--serve", "64", "--max-seqs", "0"], "--max-seqs 0: caps the sequences served at once"),
        (["--serve", "64", "--batch", "8"], "--batch: a serving workload sizes its own batch from the memory"),
        (["--serve", "300"], "--serve 300: the step needs 300 positions, past the model's 256"),
        (["--context", "64", "--prompt-share", "0.5"], "--prompt-share goes with --serve CONTEXT"),
        (["--context", "64", "--max-seqs", "4"], "--max-seqs goes with --serve CONTEXT"),
    ],
)
def test_bad_serving_arguments_are_one_line(qwen3, args, message, capsys):
    try:
        code = main(["plan", "--model", str(qwen3[0]), "--devices", "2", "--device", "910b", *args])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and message in captured.err and captured.out == ""
    assert len([ln for ln in captured.err.strip().splitlines() if "error" in ln]) == 1


def test_the_plan_check_warns_past_its_tolerance_naming_the_term():
    from functional_npu.cli.plan_command import PLAN_CHECK_TOLERANCE, plan_check
    from functional_npu.runtime.planning import Workload, candidates, estimate

    from ..support.configs import DENSE

    predicted = estimate(DENSE, candidates(DENSE, 1)[0], "910b", Workload.decode(2, 16))
    record, warning = plan_check(predicted, predicted.step_s * (1 + PLAN_CHECK_TOLERANCE / 2))
    assert warning is None and record["error"] == pytest.approx(PLAN_CHECK_TOLERANCE / 2)
    record, warning = plan_check(predicted, predicted.step_s * (2 + PLAN_CHECK_TOLERANCE))
    assert warning.startswith("warning: plan check: the decode step took ") and "\n" not in warning
    assert f"the model's {predicted.bottleneck} term missed" in warning and record["term"] == predicted.bottleneck
    assert plan_check(predicted, None) == ({**record, "measured_decode_ms": None, "error": None}, None)


def test_an_invariant_plan_the_model_cannot_run_is_refused_before_any_rank_starts(qwen3, tmp_path, capsys):
    """Once refused only after every rank had started and loaded (exit 2 from the ranks)."""
    from functional_npu.parallel.module_tp import split_dp
    from functional_npu.placement import place
    from functional_npu.runtime.loading import read_config

    axes, module_tp = split_dp({"dp": 2, "tp": 1}, {"mlp": 2})
    plan = Plan(module_tp=module_tp, invariant=True)
    plan_file = tmp_path / "invariant.json"
    plan_file.write_text(place(read_config(qwen3[0]), axes, plan).to_json())
    refused(
        ["generate", "--model", str(qwen3[0]), "--plan", str(plan_file), "--prompt-ids", "1", "--max-new-tokens", "2"],
        f"--plan {plan_file}: Plan.invariant: module TP (",
        capsys,
    )
