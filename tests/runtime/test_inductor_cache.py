"""Inductor's cache after a killed compile: the zero-byte and truncated objects a killed linker leaves (GNU ld
writes its output without execute bits and sets them as it closes a complete one) are found and removed with
their build directories, never a complete object nor one whose build a live process holds; LocalWorld sweeps
after it kills ranks and when a world starts, compile_model before an inductor compile."""

import fcntl
import os
import time
from pathlib import Path

import pytest
import torch

from functional_npu.runtime.launch import LocalWorld
from functional_npu.runtime.serving.inductor_cache import incomplete_objects, inductor_root, sweep

REAL = Path(torch.__file__).parent / "lib" / "libtorch_global_deps.so"  # a small real shared object


def _object(root: Path, name: str, data: bytes, mode: int = 0o755) -> Path:
    path = root / name[1:3] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _cache(root: Path) -> dict[str, Path]:
    """An inductor cache with complete objects and what killed builds leave."""
    real = REAL.read_bytes()
    return {
        "good": _object(root, "cgood.so", real),
        "good_o": _object(root, "cgoodo.main.o", real, 0o644),
        "zero": _object(root, "czero.main.so", b"", 0o644),  # the linker opened its output, then was killed
        "truncated": _object(root, "ctrunc.so", real[: len(real) // 2], 0o644),  # killed while writing
        "header_only": _object(root, "chead.so", real[:64], 0o644),
        "not_elf": _object(root, "cjunk.so", b"\0" * 4096, 0o644),  # space reserved, nothing written yet
        "truncated_o": _object(root, "ctrunco.o", real[:100], 0o644),
    }


def test_the_incomplete_objects_are_found_and_removed_with_their_build_dirs(tmp_path):
    files = _cache(tmp_path)
    build = files["zero"].with_name("czero.main_CxxBuild")  # inductor's build directory beside its target
    build.mkdir()
    bad = sorted(p for k, p in files.items() if not k.startswith("good"))
    assert incomplete_objects(tmp_path) == bad
    assert sweep(tmp_path) == bad
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted([files["good"], files["good_o"]])
    assert not build.exists()
    assert sweep(tmp_path) == [] and incomplete_objects(tmp_path / "absent") == []


def test_a_truncated_object_with_its_execute_bits_is_checked_when_written_since_the_kill(tmp_path):
    """An object that looks finished (mode 755) is read only when written after ``since``: a sweep of a large
    cache stats each file and reads only the suspects."""
    path = _object(tmp_path, "cfull.so", REAL.read_bytes()[:5000])
    assert incomplete_objects(tmp_path) == []
    assert sweep(tmp_path, since=time.time() + 60) == [] and path.exists()
    assert sweep(tmp_path, since=time.time() - 60) == [path] and not path.exists()


def test_an_object_whose_build_a_live_process_holds_is_left_alone(tmp_path):
    path = _object(tmp_path, "cbusy.main.so", b"", 0o644)
    (tmp_path / "locks").mkdir()
    fd = os.open(tmp_path / "locks" / "cbusy.lock", os.O_RDWR | os.O_CREAT)  # inductor's lock for that build
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert incomplete_objects(tmp_path) == [path] and sweep(tmp_path) == [] and path.exists()
    finally:
        os.close(fd)
    assert sweep(tmp_path) == [path]


def test_the_root_is_inductors(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
    assert inductor_root() == tmp_path / "c"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert inductor_root() == Path(default_cache_dir())


def _plant_and_hang(ctx, name: str, data: bytes) -> None:
    """Write a finished-looking object (mode 755) into inductor's cache, as a linker does, then never return."""
    root = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    _object(root, name, data)
    time.sleep(120)


def test_a_world_that_kills_its_rank_leaves_no_incomplete_object(tmp_path, monkeypatch):
    """A world that starts removes what a process killed outside the library left; a rank killed at the run's
    deadline while an object it wrote is incomplete: the world removes it as it kills the rank (even one that
    has its execute bits)."""
    root = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    left = _object(root, "cleft.so", b"", 0o644)  # as a kill -9 of a whole earlier run leaves
    with LocalWorld(1, threads=1) as world:
        assert not left.exists()
        with pytest.raises(TimeoutError):
            world.run(_plant_and_hang, "chalf.so", REAL.read_bytes()[:3000], timeout=2)
        assert not (root / "ha" / "chalf.so").exists()


def test_compile_model_sweeps_before_an_inductor_compile(tmp_path, monkeypatch):
    from functional_npu import Mesh, compile_model
    from functional_npu.models import llama

    from ..support.configs import DENSE

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    left = _object(tmp_path, "czero.so", b"", 0o644)
    keep = _object(tmp_path, "cgood.so", REAL.read_bytes())
    compile_model(llama.init_params(DENSE), Mesh.abstract({"tp": 1}, 0), backend="none")
    assert left.exists()  # no inductor, no sweep
    compile_model(llama.init_params(DENSE), Mesh.abstract({"tp": 1}, 0), backend="inductor")
    assert not left.exists() and keep.exists()
