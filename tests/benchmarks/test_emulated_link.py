"""The prefetch benchmark on the emulated link, end to end; and the cost model checked against a benchmark
result: which runs it reads, and what it predicts for them."""

import math
import os
import shutil
import signal
import subprocess
import time

import pytest

from benchmarks.emulated_link import model_check, private_tmp_env, run_emulated, stop_group
from benchmarks.shaped_link import link_unavailable


def _result(compute_s, comm_s, measured):
    runs = {f"k{k}": {"k": k, "schedule": "prefetch", "exposed": e} for k, e in measured.items()}
    runs["raise_comms_k1"] = {"k": 1, "schedule": "raise_comms", "exposed": 0.5}  # not the model's schedule
    return {
        "layers": 6,
        "per_layer_compute_s": compute_s,
        "per_layer_comm_s": comm_s,
        "per_layer_bytes": 2**20,
        "runs": runs,
    }


def test_model_check_on_a_link_that_keeps_up():
    """A broadcast shorter than a layer: the model predicts everything exposed without prefetch and nothing
    from k = 1 on; the errors are the measurements' distance from that, and auto picks k = 1."""
    check = model_check(_result(0.010, 0.007, {0: 0.9, 1: 0.1, 2: 0.04}))
    assert [r["k"] for r in check["rows"]] == [0, 1, 2]  # inductor's own schedules are not the model's
    assert [r["predicted"] for r in check["rows"]] == pytest.approx([1.0, 0.0, 0.0])
    assert [r["error"] for r in check["rows"]] == pytest.approx([-0.1, 0.1, 0.04])
    assert check["max_abs_error"] == pytest.approx(0.1)
    assert check["auto_k"] == 1


def test_model_check_on_a_link_slower_than_compute():
    """Broadcasts twice a layer's compute: half of each stays exposed at any k, and auto takes the
    smallest k that reaches that (with its 25% margin)."""
    check = model_check(_result(0.010, 0.020, {0: 1.0, 1: 0.6, 2: 0.5, 3: 0.5}))
    predicted = {r["k"]: r["predicted"] for r in check["rows"]}
    assert predicted[0] == pytest.approx(1.0)
    assert predicted[3] == pytest.approx(0.5) and predicted[1] >= predicted[2] >= predicted[3]
    assert check["auto_k"] >= 2


def test_layer_sharded_decode_on_the_emulated_link(tmp_path):
    """The demo's small model, o_proj and down layer-sharded over 2 ranks, at batch 16 on a link whose rate makes one
    layer's broadcast take one layer's compute (as the run measures it): k = 0 and k = 1 each give a step time
    and the fraction of the communication left exposed."""
    from functional_npu.cli.demo import DEMO_SERIES, SMALL_CONFIG
    from functional_npu.models.llama import init_params
    from functional_npu.runtime.loading.save import save_checkpoint

    why = link_unavailable()
    if why is not None:
        assert why.startswith("emulated link skipped: ") and "\n" not in why
        pytest.skip(why)  # a machine without namespaces or tc: the benchmark reports this line instead
    save_checkpoint(init_params(SMALL_CONFIG, seed=0), tmp_path)
    res = run_emulated(
        str(tmp_path), series=DEMO_SERIES, ks=(0, 1), batch=16, steps=2, repeat=2, stock=False, timeout=600
    )  # a smoke run of the benchmark's path: its figures come from python -m benchmarks prefetch
    assert set(res["runs"]) == {"k0", "k1"} and res["rounds"] == 2
    assert res["rate_bits"] >= 1_000_000 and res["local_step_s"] > 0
    assert res["per_layer_comm_s"] > 0 and res["per_layer_compute_s"] > 0
    for r in res["runs"].values():
        assert r["step_s"] > 0 and math.isfinite(r["exposed"])


def _compiling(where):
    """A C compiler started in its own process group on a source long enough to be stopped mid-compile, with its
    ``TMPDIR`` in ``where / "tmp"``; returned once its ``cc*.s`` temporary exists."""
    where.mkdir()
    src, tmp = where / "big.c", where / "tmp"
    tmp.mkdir()
    body = "int f{0}(int x) {{ int s = 0; for (int j = 0; j < x; j++) s += j * {0} % 7; return s; }}"
    src.write_text("\n".join(body.format(i) for i in range(40000)))
    argv = [shutil.which("cc") or shutil.which("gcc"), "-O2", "-c", str(src), "-o", str(where / "big.o")]
    proc = subprocess.Popen(argv, env=dict(os.environ, TMPDIR=str(tmp)), start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(tmp.glob("cc*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(tmp.glob("cc*")), "the compiler finished before it could be stopped"
    return proc, tmp


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_a_stopped_run_leaves_no_compiler_temporary(tmp_path):
    """The emulated-link run is stopped with SIGTERM first, so a compiler in it removes its ``cc*.s``; SIGKILL alone
    (the control) leaves it, which the run's private ``TMPDIR`` then takes away with the run's directory."""
    proc, tmp = _compiling(tmp_path / "term")
    stop_group(proc)
    assert list(tmp.iterdir()) == []
    proc, tmp = _compiling(tmp_path / "kill")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p.name[:2] for p in tmp.iterdir()] == ["cc"]


def test_the_emulated_runs_temporaries_are_its_own_and_inductors_cache_is_kept(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = private_tmp_env(str(tmp_path))
    assert env["TMPDIR"] == str(tmp_path / "tmp") and (tmp_path / "tmp").is_dir()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == (os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
