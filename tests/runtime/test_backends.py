"""Backend choice: inductor without an NPU, a clean fallback when torch_npu is installed but broken, clear errors."""

import subprocess
import sys
import textwrap

import pytest

from functional_npu.parallel.streams import COPY_BACK, INLINE
from functional_npu.runtime.serving.backends import BACKENDS, FASTEST_MODES, modes, resolve_backend


def test_auto_is_inductor_on_cpu_in_the_mode_measured_fastest_there():
    b = resolve_backend("auto", device_type="cpu")
    assert (b.name, b.device_type, b.mode) == ("inductor", "cpu", FASTEST_MODES["cpu"])
    assert resolve_backend("inductor", mode="default", device_type="cpu").mode == "default"
    assert resolve_backend("eager").compiler == "eager" and resolve_backend("aot_eager").name == "aot_eager"


def test_backend_errors():
    with pytest.raises(
        ValueError, match=r"unknown backend 'tvm'; choose one of auto, inductor, torchair, eager, aot_eager"
    ):
        resolve_backend("tvm")
    with pytest.raises(ValueError, match=r"backend 'torchair' compiles for an Ascend NPU, but the params are on 'cpu'"):
        resolve_backend("torchair", device_type="cpu")
    with pytest.raises(ValueError, match=r"backend 'torchair' needs a working Ascend NPU: torch_npu is not importable"):
        resolve_backend("torchair")
    with pytest.raises(ValueError, match=r"^mode 'turbo': backend 'inductor' on 'cpu' has the modes default, "):
        resolve_backend("inductor", mode="turbo", device_type="cpu")
    with pytest.raises(ValueError, match=r"^mode 'default': backend 'eager' on 'cpu' takes no mode"):
        resolve_backend("eager", mode="default", device_type="cpu")
    with pytest.raises(ValueError, match=r"^options \['capture_limit'\] are npugraph_ex's CompilerConfig options"):
        resolve_backend("inductor", options={"capture_limit": 8})
    assert modes("torchair", "npu") == ("max-autotune", "reduce-overhead") and modes("none", "cpu") == ()


def test_broken_torch_npu_falls_back_with_one_log_line(tmp_path):
    """torch-npu installed without CANN: importing it fails; auto must fall back, never crash."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libhccl.so: cannot open shared object file')\n")
    code = textwrap.dedent(
        """
        import logging, sys
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        sys.path.insert(0, sys.argv[1])
        from functional_npu.runtime.serving.backends import resolve_backend
        print(resolve_backend("auto").name)
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "inductor"
    lines = [ln for ln in out.stderr.splitlines() if "functional_npu" in ln]
    assert lines == [
        "functional_npu: no usable NPU "
        "(torch_npu is not importable (OSError: libhccl.so: cannot open shared object file)); using inductor"
    ]


def test_ordering_hints_add_nothing_off_torchair():
    import torch

    for name in BACKENDS:
        if name not in ("torchair", "npugraph_ex", "aot_eager"):  # the first two need an NPU
            assert resolve_backend(name).streams is INLINE
    # aot_eager copies mutated inputs back after the graph: the ring's hand-over is waited first
    assert resolve_backend("aot_eager").streams is COPY_BACK
    x, y = torch.ones(2), torch.zeros(2)
    with INLINE.side("prefetch"):
        z = x + 1
    assert INLINE.after(z, y) is z
