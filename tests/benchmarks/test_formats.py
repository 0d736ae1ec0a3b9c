"""Weight formats: one model written four ways, and the table of a result."""


def test_formats_are_one_model_written_four_ways(tmp_path):
    """fp32, bf16, int8 and int4 of the same seeded weights; the bytes a decode token reads shrink with the format
    (every linear layer quantized, lm_head included)."""
    import dataclasses

    from benchmarks.configs import QUICK
    from benchmarks.formats import FORMATS, decode_bytes, write_formats
    from functional_npu import Mesh
    from functional_npu.models.linear import prepare_params
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    cfg = dataclasses.replace(QUICK, num_layers=1, vocab_size=512)
    paths = write_formats(cfg, tmp_path)
    mesh = Mesh.abstract({"tp": 1}, 0)
    sizes = {}
    for name, path in paths.items():
        loaded = load_checkpoint(path, mesh)
        params = prepare_params(loaded, loaded.placement.quant)
        assert params["embed"].dtype == FORMATS[name][0]
        assert (loaded.placement.quant is not None) == (FORMATS[name][1] is not None)
        sizes[name] = decode_bytes(params)
    assert sizes["fp32"] > 1.9 * sizes["bf16"] > 1.9 * 1.8 * sizes["int8"] > 1.9 * 1.8 * 1.6 * sizes["int4"]


def _run(ours: list[float], peer: list[float], read_gb_s: list[float], flops: float = 0.0) -> dict:
    """One run's decode result for fp32 at batch 1 only, from per-round tok/s and read bandwidths (a matmul peak of
    1 TFLOP/s, and ``flops`` a step)."""
    from benchmarks.formats import cells
    from benchmarks.timing import stats

    decode = {"fnpu_fp32": {"1": ours}, "hf_fp32": {"1": peer}}
    nbytes = 200_000_000
    return {
        "cells": cells(decode, {"fp32": {"1": (nbytes, flops)}}, [g * 1e9 for g in read_gb_s], {"fp32": [1e12] * 3}),
        "systems": {k: {b: stats(v) for b, v in per.items()} for k, per in decode.items()},
        "skipped": {"torchao_int4": "torchao int4 weight-only does not run on this CPU"},
    }


def test_cells_take_shares_ratios_and_fixed_cost_round_by_round():
    """A round's share uses that round's read bandwidth, and the ratio pairs figures of the same round: a slow
    round slows both systems and the roofline alike, and changes no ratio."""
    run = _run(ours=[100.0, 50.0, 120.0], peer=[80.0, 40.0, 100.0], read_gb_s=[40.0, 20.0, 40.0])
    cell = run["cells"]["fp32"]["1"]
    assert cell["share_of_roofline"] == {"median": 0.5, "min": 0.5, "max": 0.6}  # 100 * 0.2 GB / 40 GB/s, ...
    assert cell["binds"] == "memory"
    assert cell["peers"]["hf_fp32"]["median"] == 1.25 and cell["peers"]["hf_fp32"]["min"] == 1.2
    assert cell["fixed_ms"]["median"] == 5.0  # 10 ms a step, 5 ms of weight bytes at 40 GB/s
    # 10 GFLOP a step at 1 TFLOP/s: 10 ms, more than the 5 ms of reading: compute binds, the share doubles
    cell = _run(ours=[100.0] * 3, peer=[80.0] * 3, read_gb_s=[40.0] * 3, flops=1e10)["cells"]["fp32"]["1"]
    assert cell["binds"] == "compute" and cell["share_of_roofline"]["median"] == 1.0 and cell["fixed_ms"]["max"] == 0


def test_the_peer_is_the_faster_wrapper_in_each_round():
    from benchmarks.formats import faster_wrapper

    decode = {"hf_fp32_cpp": {"8": [10.0, 30.0]}, "hf_fp32_py": {"8": [20.0, 25.0]}, "fnpu_fp32": {"8": [1.0, 1.0]}}
    assert faster_wrapper(decode)["hf_fp32"] == {"8": [20.0, 30.0]}
    assert "hf_bf16" not in faster_wrapper(decode)


def test_targets_need_every_run_and_the_table_shows_both():
    from benchmarks.formats import format_table, targets, targets_table

    good = _run(ours=[180.0] * 3, peer=[100.0] * 3, read_gb_s=[40.0] * 3)  # 90% of the roofline, 1.8x
    bad = _run(ours=[140.0] * 3, peer=[150.0] * 3, read_gb_s=[40.0] * 3)  # 70%, 0.93x
    rows = {r["target"]: r for r in targets([good, bad])}
    share = rows["fp32 at batch 1 >= 80% of the read roofline"]
    assert share["figures"] == ["90%", "70%"] and not share["met"]
    assert {r["target"]: r for r in targets([good, good])}["fp32 at batch 1 >= 1.2x hf_fp32"]["met"]
    assert not rows["fp32 at batch 1 >= 1.2x hf_fp32"]["met"]
    assert not any(t.startswith(("bf16", "int8", "int4")) for t in rows)  # formats no run measured: no rows
    assert rows["fp32 at batch 8 >= 50% of the memory-and-compute roofline"]["figures"] == ["not run", "not run"]
    assert not any("compile" in t for t in rows)  # no run timed its compiles
    assert rows["fp32 fixed cost per batch-1 step <= 1.0 ms"]["figures"] == ["0.56 ms", "2.14 ms"]
    table = format_table([good, bad])
    assert "| fp32 | 1 | 180.0 (180.0-180.0) / 140.0 (140.0-140.0) | 90% / 70% (memory) |" in table
    assert "torchao_int4 (run 2): torchao int4 weight-only does not run on this CPU" in table
    # a peer one run measured and the other did not: its figure, and "not run" for the other
    no_peer = bad | {"cells": {"fp32": {"1": bad["cells"]["fp32"]["1"] | {"peers": {}}}}}
    assert "| hf_fp32 not run / 0.93x (0.93-0.93) |" in format_table([no_peer, bad])
    assert "| fp32 at batch 1 >= 80% of the read roofline | 90% / 70% | missed |" in targets_table(targets([good, bad]))


def test_the_cold_compile_target_is_ours_over_the_peers_default_wrapper_in_each_run():
    from benchmarks.formats import compile_ratio, targets

    fast = _run(ours=[180.0] * 3, peer=[100.0] * 3, read_gb_s=[40.0] * 3) | {
        "compile_s": {"fnpu_fp32": 300.0, "hf_fp32_py": 400.0, "hf_fp32_cpp": 100.0}
    }
    slow = fast | {"compile_s": {"fnpu_fp32": 500.0, "hf_fp32_py": 400.0}}
    assert compile_ratio(fast, "fp32") == 0.75 and compile_ratio(fast, "bf16") is None
    row = {r["target"]: r for r in targets([fast, slow])}[
        "fp32 cold compile <= transformers' (default wrapper), ours / theirs"
    ]
    assert row["figures"] == ["0.75x", "1.25x"] and not row["met"]


def test_with_one_wrapper_built_the_peer_is_that_one():
    from benchmarks.formats import faster_wrapper

    decode = {"hf_bf16_py": {"1": [20.0, 25.0]}, "fnpu_bf16": {"1": [1.0, 1.0]}}
    assert faster_wrapper(decode)["hf_bf16"] == {"1": [20.0, 25.0]}


def test_compiled_graphs_counts_each_graph_dynamo_builds():
    import torch

    from benchmarks.formats import compiled_graphs

    before = compiled_graphs()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    f(torch.ones(3))
    f(torch.ones(3))  # the same shape: no new graph
    f(torch.ones(5))  # another shape, static: one more
    assert compiled_graphs() - before == 2


def test_a_run_of_the_quantized_formats_alone_writes_the_bf16_checkpoint_its_peer_quantizes():
    """torchao's peer quantizes the bf16 model: ``--formats int8,int4`` writes bf16's checkpoint too (without it the
    run failed after compiling ours); a run of float formats writes only theirs."""
    from benchmarks.formats import checkpoints

    assert checkpoints(("int8", "int4")) == ("bf16", "int8", "int4")
    assert checkpoints(("int4",)) == ("bf16", "int4")
    assert checkpoints(("fp32",)) == ("fp32",)
    assert checkpoints(("bf16", "fp32")) == ("fp32", "bf16")


def test_the_table_of_runs_of_other_formats_shows_each_format_with_not_run_for_the_runs_without_it():
    """A run of int8 appended to a run of fp32 (``--formats int8,int4 --append``): both formats in the table, each
    with "not run" where a run did not measure it (a run of other formats raised KeyError after its rounds)."""
    from benchmarks.formats import format_table

    fp32 = _run(ours=[180.0] * 3, peer=[100.0] * 3, read_gb_s=[40.0] * 3)
    int8 = fp32 | {"cells": {"int8": fp32["cells"]["fp32"]}}
    table = format_table([fp32, int8])
    assert "| fp32 | 1 | 180.0 (180.0-180.0) / not run | 90% / not run (memory) |" in table
    assert "| int8 | 1 | not run / 180.0 (180.0-180.0) | not run / 90% (memory) |" in table
    assert "hf_fp32 1.80x (1.80-1.80) / not run" in table


def test_a_run_of_other_formats_neither_meets_nor_misses_a_formats_targets():
    """Runs of fp32 and a run of int8 appended: fp32's targets are judged on the runs of fp32 ("-" for the int8 run,
    which does not make them missed), int8's on its own run."""
    from benchmarks.formats import targets

    fp32 = _run(ours=[180.0] * 3, peer=[100.0] * 3, read_gb_s=[40.0] * 3)  # 90%, 1.8x
    int8 = fp32 | {"cells": {"int8": fp32["cells"]["fp32"]}}
    rows = {r["target"]: r for r in targets([fp32, fp32, int8])}
    peer = rows["fp32 at batch 1 >= 1.2x hf_fp32"]
    assert peer["figures"] == ["1.80x", "1.80x", "-"] and peer["met"]
    share = rows["int8 at batch 1 >= 60% of the read roofline"]
    assert share["figures"] == ["-", "-", "90%"] and share["met"]
    # a cell its own format's run did not measure is still missed
    assert rows["fp32 at batch 8 >= 50% of the memory-and-compute roofline"]["figures"] == ["not run", "not run", "-"]
    assert not rows["fp32 at batch 8 >= 50% of the memory-and-compute roofline"]["met"]
