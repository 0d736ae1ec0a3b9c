"""The conversion process's set-up: torch_npu refused without a trace, torchair's native module served
by the stand-in that ends conversion where GE would take the graph; and the wheel cache."""

import json
import subprocess
import sys
import textwrap
import zipfile

import pytest

from functional_npu.npu.wheel import OP_TABLE, TorchairUnavailable, cached, torchair_sources, unpack
from tools.aten_graphs import CASES
from tools.ge_graphs import FIXES, case_artifacts, ge_artifacts

from ..support import ROOT


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **env),
    )


def test_install_blocks_torch_npu_and_serves_the_standin(tmp_path):
    (tmp_path / "torchair" / "core").mkdir(parents=True)
    (tmp_path / "torchair" / "__init__.py").write_text("")
    (tmp_path / "torchair" / "core" / "__init__.py").write_text("")
    done = _python(
        f"""
        import sys
        from pathlib import Path
        from functional_npu.npu import host
        host.install(Path({str(tmp_path)!r}))
        for name in ("torch_npu", "torch_npu.npu", "torchair.core._npu_utils"):
            try:
                __import__(name)
            except ImportError:
                pass
            else:
                raise SystemExit(name + " imported")
        assert not any(m == "torch_npu" or m.startswith("torch_npu.") for m in sys.modules)
        from torchair.core import _torchair
        assert _torchair.check_cann_compat("MatMul", [], []) == ""
        graph = _torchair.TorchNpuGraphBase("g")
        try:
            graph.load(b"model", {{}}, [], [], 0)
        except host.HandedToGE as e:
            print("handed:", e)
        assert host.handed() == [("g", b"model")]
        try:
            graph.run(())
        except RuntimeError as e:
            print("run:", e)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "handed: GE graph 'g' (5 bytes) handed to GE" in done.stdout
    assert "run: GE is not available on this host" in done.stdout


def test_install_refuses_a_folder_without_torchair(tmp_path):
    from functional_npu.npu import host

    with pytest.raises(FileNotFoundError, match="holds no torchair package"):
        host.install(tmp_path)


def _wheel(path, files, name: str = "torch_npu", version: str = "2.13.0"):
    """A zip as pip writes a wheel: ``files`` and ``<name>-<version>.dist-info/METADATA`` naming its release."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        for file, data in files.items():
            z.writestr(file, data)
    return path


TABLE = "supported:\n- func: mm(Tensor self, Tensor mat2) -> Tensor\n  impl_ns: acl_op, op_api\n"


def _torchair_wheel(path, which: str, version: str = "2.13.0"):
    files = {"torch_npu/dynamo/torchair/__init__.py": f"WHICH = {which!r}\n", OP_TABLE: TABLE}
    return _wheel(path, files, version=version)


def _which(root) -> str:
    return (root / "torchair" / "__init__.py").read_text()


def test_unpack_takes_the_python_sources_only_and_once(tmp_path):
    wheel = _wheel(
        tmp_path / "torch_npu-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        {
            "torch_npu/__init__.py": "raise ImportError('needs CANN')",
            "torch_npu/dynamo/torchair/__init__.py": "",
            "torch_npu/dynamo/torchair/core/_torchair.so": b"\x7fELF",
            "torch_npu/dynamo/torchair/ge/ge_ir.proto": "syntax = 'proto3';",
            "torch_npu/csrc/aten/npu_native_functions.yaml": "other: table",
            OP_TABLE: TABLE,
        },
    )
    dest = tmp_path / "cache" / "torchair-2.13.0"
    root = unpack(wheel, dest)
    assert root == dest / "torch_npu" / "dynamo"
    assert (root / "torchair" / "__init__.py").is_file() and (root / "torchair" / "ge" / "ge_ir.proto").is_file()
    assert not (root / "torchair" / "core" / "_torchair.so").exists()
    assert not (dest / "torch_npu" / "__init__.py").exists()
    assert (dest / OP_TABLE).read_text() == TABLE  # the op table, and no other file outside dynamo
    assert not (dest / "torch_npu" / "csrc" / "aten" / "npu_native_functions.yaml").exists()
    inode = dest.stat().st_ino
    assert unpack(wheel, dest) == root and dest.stat().st_ino == inode  # cached: not unpacked again
    wheel.unlink()
    assert cached(dest) == root  # and needs no wheel to be read


def test_a_bad_or_missing_wheel_is_one_line(tmp_path, monkeypatch):
    not_torch_npu = _wheel(tmp_path / "other.whl", {"other/__init__.py": "", OP_TABLE: TABLE})
    with pytest.raises(TorchairUnavailable, match="holds no torch_npu/dynamo/torchair package"):
        unpack(not_torch_npu, tmp_path / "a")
    no_table = _wheel(tmp_path / "no-table.whl", {"torch_npu/dynamo/torchair/__init__.py": ""})
    with pytest.raises(TorchairUnavailable, match=f"no-table.whl holds no {OP_TABLE}; is it a torch-npu wheel"):
        unpack(no_table, tmp_path / "a")
    no_metadata = tmp_path / "bare.whl"
    with zipfile.ZipFile(no_metadata, "w") as z:
        z.writestr("torch_npu/dynamo/torchair/__init__.py", "")
    with pytest.raises(TorchairUnavailable, match=r"bare.whl has 0 \*.dist-info/METADATA files, not 1; point"):
        unpack(no_metadata, tmp_path / "a")
    broken = tmp_path / "broken.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(TorchairUnavailable, match="cannot unpack"):
        unpack(broken, tmp_path / "b")
    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(TorchairUnavailable, match="missing.whl is not a file"):
        torchair_sources()
    artifacts, problems, skipped = ge_artifacts({})
    assert (artifacts, problems) == ({}, [])
    assert skipped.startswith("GE conversion skipped: ") and "\n" not in skipped


def test_a_wheel_of_another_release_is_refused_and_never_cached(tmp_path, monkeypatch):
    """A zip holding some other torchair (torch-npu 2.5.1): refused in one line, naming what it is; the cache
    stays empty, so the right wheel named next is the one used."""
    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path / "cache"))
    old = _torchair_wheel(tmp_path / "torch_npu-2.5.1-cp311-cp311-linux_x86_64.whl", "old", version="2.5.1")
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(old))
    with pytest.raises(TorchairUnavailable) as error:
        torchair_sources()
    assert str(error.value).startswith(f"{old} is torch_npu 2.5.1, not torch-npu 2.13.0; point ") and "\n" not in str(
        error.value
    )
    assert not (tmp_path / "cache" / "torchair-2.13.0").exists()
    other = _wheel(tmp_path / "x.whl", {"torch_npu/dynamo/torchair/__init__.py": ""}, name="torchair", version="2.13.0")
    with pytest.raises(TorchairUnavailable, match=r"x.whl is torchair 2.13.0, not torch-npu 2.13.0"):
        unpack(other, tmp_path / "cache" / "torchair-2.13.0")
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(_torchair_wheel(tmp_path / "good.whl", "good")))
    assert _which(torchair_sources()) == "WHICH = 'good'\n"


def test_the_named_wheel_replaces_a_cache_of_another(tmp_path, monkeypatch):
    """A cache poisoned by an earlier release's marker (a wrong wheel, marked done, as a bare file name), or
    holding another wheel than the one now named: the named wheel is unpacked, never the cache trusted."""
    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path / "cache"))
    dest = tmp_path / "cache" / "torchair-2.13.0"
    (dest / "torch_npu" / "dynamo" / "torchair").mkdir(parents=True)
    (dest / "torch_npu" / "dynamo" / "torchair" / "__init__.py").write_text("WHICH = 'poisoned'\n")
    (dest / ".unpacked").write_text("some-other.whl\n")  # what the marker said before it recorded digests
    assert cached(dest) is None
    first = _torchair_wheel(tmp_path / "first.whl", "first")
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(first))
    assert _which(torchair_sources()) == "WHICH = 'first'\n"
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(_torchair_wheel(tmp_path / "second.whl", "second")))
    assert _which(torchair_sources()) == "WHICH = 'second'\n"
    monkeypatch.delenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL")
    assert _which(torchair_sources()) == "WHICH = 'second'\n"  # no wheel named: the verified cache serves


def test_a_cache_whose_files_changed_is_unpacked_again(tmp_path, monkeypatch):
    """Files edited, removed or added after the unpack (a half-deleted cache, a stray edit) no longer match
    the marker's digest: the cache is not trusted; with the wheel named it is unpacked again."""
    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path / "cache"))
    wheel = _torchair_wheel(tmp_path / "good.whl", "good")
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(wheel))
    root = torchair_sources()
    dest = root.parent.parent
    (root / "torchair" / "__pycache__").mkdir()
    (root / "torchair" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0")  # an import's bytecode
    assert cached(dest) == root
    for change in (
        lambda: (root / "torchair" / "__init__.py").write_text(""),
        lambda: (root / "torchair" / "__init__.py").unlink(),
        lambda: (root / "torchair" / "stray.py").write_text("x = 1\n"),
        lambda: (dest / ".unpacked").write_text("{not json"),
    ):
        change()
        assert cached(dest) is None
        assert _which(torchair_sources()) == "WHICH = 'good'\n" and cached(dest) == root
    (dest / ".unpacked").write_text("torch_npu-2.13.0-cp311-cp311-linux_x86_64.whl\n")  # an older cache: its name
    assert cached(dest) == root


def test_a_case_torchair_cannot_convert_names_the_op_family_and_phase():
    case = next(c for c in CASES if c.family == "qwen3_moe" and c.phase == "decode")
    got = {"error": "RuntimeError: Failed to auto-generated converter", "op": "aten._weight_int8pack_mm.default"}
    files, problems = case_artifacts(case, got, [])
    assert files == {} and len(problems) == 1
    assert problems[0].startswith(f"{case.name} (family qwen3_moe, decode): torchair cannot convert ")
    assert "aten._weight_int8pack_mm.default" in problems[0] and problems[0].endswith(FIXES)


def test_torchair_names_the_op_it_has_no_converter_for():
    """Through torchair itself: an op with no GE converter fails conversion, and the error names it."""
    sources = torchair_sources()
    done = _python(
        f"""
        import json
        from pathlib import Path
        from functional_npu.npu import host
        host.install(Path({str(sources)!r}))
        import torch
        from tools.ge_graphs import convert, _error

        def uses_a_cpu_kernel(x, w, scale):
            return torch.ops.aten._weight_int8pack_mm(x, w, scale) + 1

        def fine(x, w):
            return torch.nn.functional.silu(x @ w)

        meta = dict(device="meta")
        graph = convert(fine, (torch.randn(4, 8, **meta), torch.randn(8, 8, **meta)))
        print(json.dumps([op.type for op in graph.op]))
        try:
            convert(uses_a_cpu_kernel, (torch.randn(4, 64, **meta), torch.zeros(32, 64, dtype=torch.int8, **meta),
                                        torch.randn(32, **meta)))
        except Exception as e:
            print(json.dumps(_error(e)))
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == ["Data", "Data", "MatMul", "Swish", "NetOutput"]
    error = json.loads(lines[-1])
    assert error["op"] == "aten._weight_int8pack_mm.default"
    assert "converter" in error["error"]


def test_a_cache_path_that_is_a_file_is_named_not_the_wheel(tmp_path, monkeypatch):
    """FUNCTIONAL_NPU_CACHE naming a file: one line naming the cache and the fix, before any download (before:
    "cannot unpack <the wheel>: Not a directory", blaming a good wheel)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path / "file"))
    monkeypatch.setenv("FUNCTIONAL_NPU_TORCH_NPU_WHEEL", str(_torchair_wheel(tmp_path / "good.whl", "good")))
    with pytest.raises(TorchairUnavailable) as error:
        torchair_sources()
    assert str(error.value) == (
        f"torchair's sources cannot be unpacked: the cache directory {tmp_path / 'file'} cannot be made: "
        f"{tmp_path / 'file'} is not a directory; set FUNCTIONAL_NPU_CACHE to a writable directory"
    )
    (tmp_path / "dest").write_text("")  # a destination that cannot be written, given to unpack directly
    with pytest.raises(TorchairUnavailable, match=r"cannot unpack good.whl into .*dest/x: .*set FUNCTIONAL_NPU_CACHE"):
        unpack(tmp_path / "good.whl", tmp_path / "dest" / "x")
