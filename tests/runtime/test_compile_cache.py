"""compile_model(cache_dir=...): a fresh process loads the saved graphs and compiles none; a foreign, unreadable,
corrupted, unwritable or full cache is one warning and a clean compile; a killed writer leaves nothing trusted.

The in-process cases compile with ``aot_eager`` (its graphs save and load like inductor's, in seconds); the
fresh-process case with inductor, whose C++ kernels are part of what a warm process must not rebuild."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from functional_npu import Mesh, compile_model, load_checkpoint
from functional_npu.models import llama
from functional_npu.runtime.loading.save import save_checkpoint
from functional_npu.runtime.serving import compile_cache

from ..support import ROOT

PROMPTS, NEW = [[3, 1, 4]], 2  # a prefill graph (1 x 8) and a decode graph (1 x 1)
GRAPHS = ["forward-1x8-last", "forward-1x1"]
SHAPES = dict(batch_sizes=[1], max_seq_len=16, prefill_lengths=[8])
CFG = llama.LlamaConfig(
    architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
)  # fmt: skip
CHILD = """
import json, sys, torch
from functional_npu import Mesh, compile_model, load_checkpoint
path, cache, backend, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
mesh = Mesh.abstract({"tp": 1}, 0)
model = compile_model(load_checkpoint(path, mesh), mesh, backend=backend, cache_dir=cache, **%r)
tokens = model.generate(%r, %d)
c = torch._dynamo.utils.counters
print(json.dumps({"tokens": tokens, "loaded": model.forward.loaded, "compiled": model.forward.compiled_now,
                  "dynamo_graphs": c["stats"]["unique_graphs"], "aot_autograd": c["aot_autograd"]["total"],
                  "inductor_passes": c["inductor"]["pattern_matcher_count"]}))
""" % (SHAPES, PROMPTS, NEW)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 1-layer checkpoint and its tokens from the plain forward."""
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(llama.init_params(CFG, seed=5), path)
    mesh = Mesh.abstract({"tp": 1}, 0)
    return str(path), compile_model(load_checkpoint(path, mesh), mesh, backend="none", **SHAPES).generate(PROMPTS, NEW)


def _compiled(path, cache_dir, backend="aot_eager"):
    mesh = Mesh.abstract({"tp": 1}, 0)
    return compile_model(load_checkpoint(path, mesh), mesh, backend=backend, cache_dir=cache_dir, **SHAPES)


@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    """A cache_dir the aot_eager graphs were saved to (copied by each test that spoils it)."""
    cache = tmp_path_factory.mktemp("saved")
    model = _compiled(ckpt[0], cache)
    assert model.generate(PROMPTS, NEW) == ckpt[1] and model.forward.compiled_now == GRAPHS
    return cache


@pytest.fixture
def cache(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "cache")
    return tmp_path / "cache"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "functional_npu" and r.levelno >= logging.WARNING]


def _clean_compile(ckpt, cache_dir, caplog, *, loaded=()) -> list[str]:
    """Compile with ``cache_dir`` and generate: the right tokens, the graphs ``loaded`` loaded and none of the others
    (compiled, and saved where the directory can be written). Returns the warnings."""
    with caplog.at_level(logging.WARNING, logger="functional_npu"):
        model = _compiled(ckpt[0], cache_dir)
        assert model.generate(PROMPTS, NEW) == ckpt[1]
    assert getattr(model.forward, "loaded", []) == list(loaded)
    return _warnings(caplog)


def _child(ckpt, cache_dir, backend, inductor_dir, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(inductor_dir))
    argv = [sys.executable, "-c", CHILD, ckpt[0], str(cache_dir), backend, str(torch.get_num_threads())]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _run_child(ckpt, cache_dir, backend, inductor_dir) -> dict:
    child = _child(ckpt, cache_dir, backend, inductor_dir)
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_fresh_process_loads_every_graph_and_compiles_none(ckpt, tmp_path):
    """Cold and warm fresh processes, each with its own empty inductor cache: the warm one traces nothing with dynamo,
    runs neither AOTAutograd nor inductor's passes, builds no kernel, and generates the same tokens."""
    cold = _run_child(ckpt, tmp_path / "cache", "inductor", tmp_path / "inductor-cold")
    warm = _run_child(ckpt, tmp_path / "cache", "inductor", tmp_path / "inductor-warm")
    assert cold["tokens"] == warm["tokens"] == ckpt[1]
    assert cold["compiled"] == GRAPHS and cold["loaded"] == []
    assert cold["dynamo_graphs"] == cold["aot_autograd"] == 2 and cold["inductor_passes"] > 0  # what warm must skip
    assert warm["loaded"] == GRAPHS and warm["compiled"] == []
    assert warm["dynamo_graphs"] == warm["aot_autograd"] == warm["inductor_passes"] == 0
    assert not list((tmp_path / "inductor-warm").rglob("*.so"))  # no kernel built outside the cache_dir either
    manifest = json.loads((tmp_path / "cache" / "tp0of1" / "manifest.json").read_text())
    assert manifest["key"]["torch"] == torch.__version__
    assert manifest["key"]["backend"] == "inductor mode=default on cpu"


def test_a_warm_load_in_process_gives_the_same_tokens(ckpt, cache, caplog):
    assert _clean_compile(ckpt, cache, caplog, loaded=GRAPHS) == []


@pytest.mark.parametrize(
    "field,value",
    [("torch", "2.12.0"), ("model", "Qwen3ForCausalLM 0123456789abcdef"), ("plan", "Plan(tp='dp')")],
)
def test_another_key_is_one_warning_then_a_clean_compile(ckpt, cache, caplog, field, value):
    """A cache of another torch / model / plan is detected from its manifest, named, dropped and rebuilt."""
    manifest = cache / "tp0of1" / "manifest.json"
    held = json.loads(manifest.read_text())
    held["key"][field] = value
    manifest.write_text(json.dumps(held))
    (old,) = [d for d in (cache / "tp0of1").iterdir() if d.is_dir()]
    old.rename(old.with_name("0000000000000000"))  # the other key's graphs, under its digest
    (warning,) = _clean_compile(ckpt, cache, caplog)
    assert f"cache_dir {cache / 'tp0of1'}: it holds graphs of another {field} ({field} {value!r}, here " in warning
    assert warning.endswith("; compiling from scratch")
    assert not (cache / "tp0of1" / "0000000000000000").exists()  # the other key's graphs are gone
    assert json.loads(manifest.read_text())["key"][field] != value
    assert _clean_compile(ckpt, cache, caplog, loaded=GRAPHS) == [warning]  # and the rebuilt ones load


def test_an_unreadable_manifest_is_one_warning_then_a_clean_compile(ckpt, cache, caplog):
    (cache / "tp0of1" / "manifest.json").write_bytes(b"\x00\xffnot json")
    (warning,) = _clean_compile(ckpt, cache, caplog)
    assert f"cache_dir {cache / 'tp0of1'}: its manifest.json cannot be read (" in warning
    assert warning.endswith("compiling from scratch")


@pytest.mark.parametrize("spoil", ["garbage", "truncated"])
def test_a_corrupted_graph_is_one_warning_then_a_clean_compile(ckpt, cache, caplog, spoil):
    """Garbage bytes or half a file in place of a graph: that graph is named, removed and compiled; the other loads."""
    (graph,) = (cache / "tp0of1").glob("*/forward-1x8-last/graph.bin")
    data = graph.read_bytes()
    graph.write_bytes(os.urandom(len(data)) if spoil == "garbage" else data[: len(data) // 2])
    (warning,) = _clean_compile(ckpt, cache, caplog, loaded=["forward-1x1"])
    assert f"cache_dir {cache / 'tp0of1'}: graph forward-1x8-last cannot be used (" in warning
    assert warning.endswith("); compiling it from scratch")
    assert graph.read_bytes() != data[: len(data) // 2] and len(graph.read_bytes()) > 0  # saved again, whole


def test_guards_that_fail_later_are_one_warning_per_graph_then_a_usual_compile(ckpt, cache, caplog):
    """A loaded graph guards on global state (torch's thread count): changed after the load, each graph's next call
    warns once and compiles as usual, with the right tokens."""
    model = _compiled(ckpt[0], cache)
    assert model.generate(PROMPTS, NEW) == ckpt[1] and model.forward.loaded == GRAPHS
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        with caplog.at_level(logging.WARNING, logger="functional_npu"):
            assert model.generate(PROMPTS, NEW) == ckpt[1]
            assert model.generate(PROMPTS, NEW) == ckpt[1]
    finally:
        torch.set_num_threads(threads)
    first, second = _warnings(caplog)
    assert first.startswith(
        f"compile_model: cache_dir {cache / 'tp0of1'}: graph forward-1x8-last rejects these inputs ("
    )
    assert second.startswith(f"compile_model: cache_dir {cache / 'tp0of1'}: graph forward-1x1 rejects these inputs (")
    assert "num_threads" in first and first.endswith("; compiling it as usual")


def test_a_cache_dir_under_a_file_is_one_warning_then_a_clean_compile(ckpt, tmp_path, caplog):
    """A path no one can create (root included): one warning naming it and why, a compile, nothing saved."""
    (tmp_path / "file").write_text("")
    (warning,) = _clean_compile(ckpt, tmp_path / "file" / "sub", caplog)
    assert f"cache_dir {tmp_path / 'file' / 'sub' / 'tp0of1'} cannot be used (ENOTDIR: Not a directory" in warning
    assert warning.endswith("; compiling from scratch, saving nothing")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to a read-only directory")
def test_a_read_only_cache_dir_is_one_warning_then_a_clean_compile(ckpt, tmp_path, caplog):
    (tmp_path / "ro").mkdir(mode=0o500)
    try:
        (warning,) = _clean_compile(ckpt, tmp_path / "ro", caplog)
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert "cannot be used (EACCES: Permission denied" in warning


def _read_only(cache, monkeypatch) -> None:
    """``cache`` made read-only: for real (mode 0o555) where the test does not run as root, and for root (which writes
    anyway) by the write probe meeting what a non-root user's would (EACCES)."""
    for d in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
        d.chmod(0o555)
    if os.geteuid() == 0:

        def refused(root):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root))

        monkeypatch.setattr(compile_cache, "_probe", refused)


def _tree(root) -> dict:
    """Every entry under ``root``: its kind, size and modification time (what any write would change)."""
    return {str(p.relative_to(root)): (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("held", [GRAPHS, GRAPHS[:1]], ids=["complete", "partial"])
def test_a_read_only_cache_with_this_key_is_loaded_and_left_untouched(ckpt, cache, caplog, monkeypatch, held):
    """A cache that cannot be written (a shared or read-only one) holding this key's graphs: every graph it holds is
    loaded, one it lacks is compiled without saving, one warning says so, and not one entry under it changes."""
    rank = cache / "tp0of1"
    for graph in set(GRAPHS) - set(held):
        (victim,) = rank.glob(f"*/{graph}")
        shutil.rmtree(victim)
    _read_only(cache, monkeypatch)
    before = _tree(cache)
    try:
        (warning,) = _clean_compile(ckpt, cache, caplog, loaded=held)
    finally:
        for d in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
    assert warning.startswith(f"compile_model: cache_dir {rank} cannot be written (EACCES: Permission denied: {rank}")
    assert warning.endswith("); loading the graphs it holds, saving none")
    assert _tree(cache) == before


def test_a_read_only_cache_of_another_key_is_one_warning_then_a_clean_compile(ckpt, cache, caplog, monkeypatch):
    """The control: a read-only cache whose graphs are another model's is not loaded from (nor emptied)."""
    manifest = cache / "tp0of1" / "manifest.json"
    held = json.loads(manifest.read_text())
    held["key"]["model"] = "another model"
    manifest.write_text(json.dumps(held))
    _read_only(cache, monkeypatch)
    before = _tree(cache)
    try:
        (warning,) = _clean_compile(ckpt, cache, caplog)
    finally:
        for d in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
    assert "cannot be used (EACCES: Permission denied" in warning and warning.endswith("saving nothing")
    assert _tree(cache) == before


@pytest.mark.parametrize("what", ["manifest.json", "graph.bin"])
def test_a_full_disk_is_one_warning_then_a_clean_compile(ckpt, tmp_path, caplog, monkeypatch, what):
    """ENOSPC writing the manifest (the directory is not used) or a graph (that graph and later ones are not
    saved): one warning, the right tokens, and no graph published."""
    write = compile_cache.write_bytes

    def full(path, data):
        if path.name == what:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(path, data)

    monkeypatch.setattr(compile_cache, "write_bytes", full)
    (warning,) = _clean_compile(ckpt, tmp_path / "cache", caplog)
    assert f"cache_dir {tmp_path / 'cache' / 'tp0of1'} cannot be " in warning
    assert "(ENOSPC: No space left on device: " in warning
    if what == "graph.bin":
        assert warning.endswith("graph forward-1x8-last and later ones compile without saving")
    assert not list((tmp_path / "cache").rglob("graph.bin"))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.endswith(".tmp")]  # no temporary left behind


def test_a_killed_writer_leaves_nothing_that_is_trusted(ckpt, tmp_path, caplog):
    """A process killed while it builds a graph leaves a ``.tmp`` directory: the next process does not read it, and
    compiles that graph cleanly with no warning."""
    cache = tmp_path / "cache"
    child = _child(ckpt, cache, "aot_eager", tmp_path / "inductor", start_new_session=True)
    deadline = time.monotonic() + 300
    while (
        not list(cache.glob("tp0of1/*/.forward-1x8-last.*.tmp"))
        and child.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    assert list(cache.glob("tp0of1/*/.forward-1x8-last.*.tmp")), "the child was not caught building its first graph"
    assert _clean_compile(ckpt, cache, caplog) == []
    assert not list(cache.glob("tp0of1/*/.*.tmp"))  # its staging directory was removed: its pid is gone


def test_staging_of_a_live_writer_or_another_host_is_left_until_stale(tmp_path):
    """The sweep removes this host's staging directories whose pid is gone, keeps a live writer's, and keeps another
    host's until a day old."""
    where = tmp_path / "digest"
    where.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = compile_cache._HOST
    names = {
        "mine-dead": f".forward-1x8.{host}.{int(dead.stdout)}.0123abcd.tmp",
        "mine-live": f".forward-1x1.{host}.{os.getpid()}.0123abcd.tmp",
        "foreign-new": ".forward-1x8.ffffffff.1.0123abcd.tmp",
        "foreign-old": ".forward-1x1.eeeeeeee.1.0123abcd.tmp",
        "graph": "forward-1x8",
    }
    for name in names.values():
        (where / name).mkdir()
    old = time.time() - compile_cache._FOREIGN_STAGING_S - 60
    os.utime(where / names["foreign-old"], (old, old))
    compile_cache._sweep_staging(where)
    left = sorted(p.name for p in where.iterdir())
    assert left == sorted([names["mine-live"], names["foreign-new"], names["graph"]])


@pytest.mark.parametrize("damage", ["manifest-dir", "graph-missing", "entry-file"])
def test_a_damaged_entry_is_one_warning_then_repaired(ckpt, cache, caplog, damage):
    """A manifest that is a directory, a graph directory without its graph.bin, or a file in place of a graph's
    directory: one warning naming it, a clean compile, and the cache repaired, so that the next run loads every
    graph with no warning (before, each was silent or permanent: every run recompiled)."""
    rank = cache / "tp0of1"
    (entry,) = rank.glob("*/forward-1x8-last")
    if damage == "manifest-dir":
        (rank / "manifest.json").unlink()
        (rank / "manifest.json").mkdir()
        expect, loaded = f"cache_dir {rank}: its manifest.json is not a file; compiling from scratch", []
    elif damage == "graph-missing":
        (entry / "graph.bin").unlink()
        expect = f"cache_dir {rank}: graph forward-1x8-last has no graph.bin; removing it and compiling it"
        loaded = GRAPHS[1:]
    else:
        shutil.rmtree(entry)
        entry.write_text("not a graph")
        expect = f"cache_dir {rank}: graph forward-1x8-last is not a directory; removing it and compiling"
        loaded = GRAPHS[1:]
    (warning,) = _clean_compile(ckpt, cache, caplog, loaded=loaded)
    assert expect in warning
    caplog.clear()
    assert _clean_compile(ckpt, cache, caplog, loaded=GRAPHS) == []  # repaired


def test_write_bytes_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "graph.bin"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        compile_cache.write_bytes(target, "not bytes")  # fails mid-write
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["graph.bin"]
    compile_cache.write_bytes(target, b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["graph.bin"]


def test_a_backend_that_cannot_save_is_one_warning(ckpt, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="functional_npu"):
        model = _compiled(ckpt[0], tmp_path / "cache", backend="eager")
        assert model.generate(PROMPTS, NEW) == ckpt[1]
    (warning,) = _warnings(caplog)
    assert f"cache_dir {tmp_path / 'cache'} is not used: backend 'eager' cannot save its graphs" in warning
    assert not (tmp_path / "cache").exists()
