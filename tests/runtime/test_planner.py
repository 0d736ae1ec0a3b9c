"""The planner: bytes per rank against what the loader really holds, the choice's properties (fits, more memory is
never slower, a refusal names a memory that does fit), the device profiles, and bad input in one line."""

import dataclasses
import json
import math
from decimal import Decimal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_npu.core.mesh import Mesh
from functional_npu.models import family as family_module
from functional_npu.models import family_of, paged
from functional_npu.parallel.devices import DEVICES, Device, Link, collective_factor, device
from functional_npu.parallel.layer_shard import resident_bytes
from functional_npu.runtime.loading.checkpoint import load_checkpoint
from functional_npu.runtime.loading.save import save_checkpoint
from functional_npu.runtime.planning import PlanDoesNotFit, Workload, candidates, choose_plan, estimate, gb_at_least

from ..support.configs import DENSE, MLA, MOE

F32 = torch.float32
WORK = Workload.decode(8, 24, F32)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("planner_dense")
    save_checkpoint(family_of(DENSE).init_params(DENSE, seed=0), path)
    return path


@pytest.fixture(scope="module")
def dense_estimates():
    return {c.name: (c, estimate(DENSE, c, "910b", WORK)) for c in candidates(DENSE, 4)}


def test_bytes_per_rank_are_what_the_loader_holds(dense_dir, dense_estimates):
    """Every candidate of a 4-device plan: the weights the estimate counts on its busiest rank are the bytes of
    the params ``load_checkpoint`` really gives that plan's ranks (the most any rank holds), and the KV cache is
    the tensors the serving engine's pools allocate for the rank's sequences (blocks of their context, and the
    null block)."""
    assert len(dense_estimates) == 19  # 3 dp x tp splits; with dp > 1 (2 of them), 5 module TP and 3 series choices
    for name, (c, e) in dense_estimates.items():
        held = []
        for r in range(c.devices):
            mesh = Mesh.abstract(c.axes, r)
            params = load_checkpoint(str(dense_dir), mesh, c.plan)
            held.append(resident_bytes(params.tree))
        assert e.bytes["weights"] == max(held), name
        mesh = Mesh.abstract(c.axes, 0)
        dp = math.prod(c.axes.values()) // c.axes["tp"]
        one = family_of(DENSE).blocks(DENSE, c.plan).init_kv(mesh, 1, WORK.cache_len, F32, "meta")
        blocks = math.ceil(WORK.batch / dp) * math.ceil(WORK.cache_len / paged.BLOCK_SIZE) + 1  # and the null one
        pools = paged.init_pools(paged.layout_of(one, WORK.cache_len), blocks, 0, paged.BLOCK_SIZE, F32, "meta")
        assert e.bytes["kv_cache"] == sum(t.numel() * t.element_size() for layer in pools for t in layer), name
        if c.plan.layer_shard is not None:  # the ring: k + 1 slots of one layer of the series
            assert e.bytes["prefetch"] > 0 and e.candidate.plan.prefetch_step >= 1


def test_kv_cache_counts_an_independent_formula():
    """Grouped-query attention at tp 2 over 2 KV heads: 2 tensors x layers x 1 head x head_dim x 2 bytes per position,
    the pool's positions 3 sequences x 7 blocks of 16 (100 positions), and the null block."""
    c = next(c for c in candidates(DENSE, 2) if c.name == "dp 1 x tp 2")
    e = estimate(DENSE, c, "h100", Workload.decode(3, 99, torch.bfloat16))
    assert e.bytes["kv_cache"] == 2 * DENSE.num_layers * 1 * DENSE.head_dim * 2 * (3 * 7 * 16 + 16)


def test_experts_are_read_as_the_tokens_touch_them():
    """One token touches top_k of the experts: a batch-1 decode reads far fewer expert bytes than a batch 64
    one, and the same weights are held either way."""
    c = next(c for c in candidates(MOE, 2) if c.name.endswith("EP 2"))
    one, many = (estimate(MOE, c, "910b", Workload.decode(b, 16, F32)) for b in (1, 64))
    assert one.bytes["weights"] == many.bytes["weights"]
    assert one.parts["memory_s"] < many.parts["memory_s"]
    assert {"all_gather", "reduce_scatter"} <= set(one.parts)  # EP at 1 token a rank: gathered, reduce-scattered
    assert "all_to_all" in many.parts  # past Plan.dispatch_threshold tokens a rank: dispatched and combined


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(low=st.floats(0.05, 4.0), extra=st.floats(0.0, 4.0), cfg=st.sampled_from([DENSE, MOE, MLA]))
def test_more_memory_never_gives_a_slower_plan_and_the_choice_fits(low, extra, cfg):
    """Budgets in MB around the tiny models' needs: the chosen plan fits its budget, a larger budget's choice is
    never slower by more than the profile's spread (a simpler plan within it may be chosen: :func:`simplest`), and a
    refusal names a memory that does fit (choosing with it succeeds)."""
    work = Workload.decode(4, 32, F32)
    chosen = {}
    for mb in (low, low + extra):
        try:
            c, report = choose_plan(cfg, 4, "910b", mb * 1e6, work)
        except PlanDoesNotFit as e:  # the figure named, read back exactly, is accepted: no slack
            figure = str(e).split("the smallest need is ")[1].split(" per device")[0]
            assert figure == e.figure and _bytes(figure) >= e.need
            c, report = choose_plan(cfg, 4, "910b", _bytes(figure), work)
            assert report.chosen.bytes["total"] == e.need
            chosen[mb] = None
            continue
        assert report.chosen.fits and report.chosen.bytes["total"] <= mb * 1e6
        assert report.chosen.placement is c and c.plan == report.chosen.candidate.plan
        chosen[mb] = report.chosen.step_s
    a, b = chosen[low], chosen[low + extra]
    if a is not None:
        assert b is not None and b <= a * (1 + device("910b").prediction_spread) * (1 + 1e-12)


def _bytes(figure: str) -> int:
    """``"1.23 MB"`` as exact bytes (decimal units)."""
    number, unit = figure.split(" ")
    return int(Decimal(number) * {"GB": 10**9, "MB": 10**6, "kB": 10**3, "B": 1}[unit])


def test_a_refused_figure_is_rounded_up_never_to_nearest():
    """67,164,931,072 bytes once read "67.16 GB", which is refused when given back."""
    assert gb_at_least(67_164_931_072) == "67.17 GB" and _bytes("67.17 GB") >= 67_164_931_072
    assert gb_at_least(67_170_000_000) == "67.17 GB"  # exact stays exact
    assert gb_at_least(999) == "999 B" and gb_at_least(1001) == "1.01 kB"


def test_a_refusal_names_the_smallest_memory_and_its_plan():
    with pytest.raises(
        PlanDoesNotFit,
        match=r"fits 1 B per device .* the smallest need is [\d.]+ [kM]B per device "
        r"\(dp \d x tp \d.*\): give each device at least that, or use more devices",
    ):
        choose_plan(DENSE, 4, "910b", 1, WORK)


def test_the_report_ranks_fitting_plans_first_and_says_why(dense_estimates):
    tight = min(e.bytes["total"] for _, e in dense_estimates.values()) * 1.5
    c, report = choose_plan(DENSE, 4, "910b", tight, WORK)
    fits = [e.fits for e in report.ranked]
    assert fits == sorted(fits, reverse=True) and report.chosen.placement is c
    steps = [e.step_s for e in report.ranked if e.fits]
    assert steps == sorted(steps)
    assert report.why().startswith(f"{report.chosen.candidate.name}: ")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["chosen"] == json.loads(c.to_json()) and data["chosen"]["axes"] == report.chosen.candidate.axes
    assert len(data["candidates"]) == len(report.ranked)
    assert "| rank | plan | step ms |" in report.table()


def test_collective_costs():
    d = Device("x", 1e12, 1e15, Link(100e9, 1e-5), links=7, node_size=8, inter_node=Link(10e9, 5e-5))
    assert d.collective_s("all_reduce", 1, 1e9) == 0
    assert d.collective_s("broadcast", 4, 1e9) == pytest.approx(1e-5 + 1e9 / 100e9)  # one link from the owner
    assert d.collective_s("all_reduce", 8, 1e9) == pytest.approx(1e-5 + 2 * 7 / 8 * 1e9 / (7 * 100e9))
    assert d.collective_s("all_gather", 16, 1e9) == pytest.approx(5e-5 + 15 / 16 * 1e9 / 10e9)  # across nodes
    measured = dataclasses.replace(d, measured={"all_reduce/2": (1e-3, 1e-9)})
    assert measured.collective_s("all_reduce", 2, 1e6) == pytest.approx(1e-3 + 1e-3)
    assert collective_factor("all_to_all", 4) == 0.75
    with pytest.raises(ValueError, match="collective 'scan' is not modelled; choose from all_reduce"):
        d.collective_s("scan", 2, 1)


def test_profiles_name_their_sources_and_assumptions():
    for name in ("910b", "910c", "h100"):
        d = device(name)
        assert d.source and d.memory_bytes and d.assumed, name
    assert device("ascend-910b") is DEVICES["ascend-910b"]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: choose_plan(DENSE, 4, "tpu-v5", 1e9, WORK),
            r"device 'tpu-v5' is not known; choose one of ascend-910b",
        ),
        (
            lambda: choose_plan(DENSE, 4, "910b", -1, WORK),
            r"memory_per_device must be a number of bytes in \[1, 1e\+18\], got -1",
        ),
        (lambda: choose_plan(DENSE, 0, "910b", 1e9, WORK), r"devices must be a positive int, got 0"),
        (lambda: Workload.decode(8, 0), r"decode needs a positive context"),
        (lambda: Workload("train", 8), r"kind must be 'decode', 'prefill' or 'serve', got 'train'"),
    ],
)
def test_bad_input_is_one_line(call, message):
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def test_a_family_without_cost_rules_is_refused_naming_it(monkeypatch):
    bare = tuple(dataclasses.replace(f, cost=None) if f.name == "llama" else f for f in family_module.FAMILIES)
    monkeypatch.setattr(family_module, "FAMILIES", bare)
    with pytest.raises(ValueError, match=r"the llama family \(Qwen3ForCausalLM\) has no cost rules yet: it needs"):
        choose_plan(DENSE, 2, "910b", 1e9, WORK)


def test_the_host_profile_is_cached_and_a_broken_cache_is_measured_again(tmp_path, monkeypatch):
    """One rank (no collectives): measured once, read back from the cache, and a file that does not parse or
    lacks a figure is measured again and rewritten, never trusted."""
    from functional_npu.runtime.planning import host_profile

    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path))
    first = host_profile.host_device(1, repeat=2)
    path = host_profile.profile_path(1)
    assert path.is_file() and path.parent == tmp_path / "host-profile"
    assert first.memory_bytes_per_s > 0 and first.flop_per_s > 0 and not first.overlap
    assert host_profile.host_device(1) == first  # from the cache: the same figures
    for broken in ("{nope", json.dumps({"version": host_profile.VERSION, "world": 1, "figures": {"measured": {}}})):
        path.write_text(broken)
        again = host_profile.host_device(1, repeat=2)
        assert again.memory_bytes_per_s > 0
        assert json.loads(path.read_text())["figures"]["linear_bytes_per_s"] > 0
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left beside it
    with pytest.raises(ValueError, match="host profile: world must be a positive int, got 0"):
        host_profile.host_device(0)


def test_a_host_profile_for_many_devices_starts_a_few_ranks_and_a_failure_is_one_line(tmp_path, monkeypatch):
    """64 devices once started 64 local ranks (and exhausted the memory); a rank's failure was its traceback."""
    from functional_npu.runtime.planning import host_profile

    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path))
    started = []

    def figures(world, repeat):
        started.append(world)
        return {"read_bytes_per_s": 1e10, "linear_bytes_per_s": 5e9, "flop_per_s": 1e11, "measured": {}}

    monkeypatch.setattr(host_profile, "_figures", figures)
    dev = host_profile.host_device(64)
    assert started == [host_profile.MEASURED_RANKS] and dev.measured_world == host_profile.MEASURED_RANKS
    assert dev.collective_s("all_reduce", 64, 1e6) > dev.collective_s("all_reduce", 2, 1e6) > 0  # the link's model
    monkeypatch.undo()

    class Failing:  # a world whose rank fails, as LocalWorld reports it: the rank's message, then its traceback
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, *args, **kwargs):
            raise RuntimeError("rank 1 raised: OSError: no memory left\n--- remote traceback (rank 1) ---\n...")

    from functional_npu.runtime import launch

    monkeypatch.setattr(launch, "LocalWorld", Failing)
    with pytest.raises(RuntimeError, match=r"^host profile: measuring this machine with 2 local ranks failed \(rank 1"):
        host_profile.measure(2, repeat=1)


def test_the_planner_refuses_a_device_count_it_cannot_weigh_in_bounded_time():
    from functional_npu.runtime.planning import MAX_DEVICES

    with pytest.raises(ValueError, match=rf"choose_plan: {MAX_DEVICES + 1} devices is more than the planner weighs"):
        choose_plan(DENSE, MAX_DEVICES + 1, "910b", 1e9, WORK)


GEMMA3_27B = {  # Gemma-3-27B's published text config (google/gemma-3-27b-it), as config.json gives it
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 5376,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "intermediate_size": 21504,
    "vocab_size": 262208,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


@pytest.mark.parametrize("tp", [1, 2])
def test_gemma3_kv_cache_holds_the_window_on_sliding_layers(tp):
    """Gemma-3-27B at 32768 positions, in the serving engine's pools (blocks of 16 and a null block per pool): a
    decode step's sliding layer holds (and reads) a ring of the window's 1024 positions and the step's one, 65 blocks;
    each full layer the context's 2048 blocks; x 2 x (16 / tp) heads x 128 x 2 bytes. A prefill of the whole prompt in
    one chunk needs a ring as long as the context (the window and the chunk): every layer holds it all."""
    from functional_npu.models import Gemma3Config

    cfg = Gemma3Config.from_hf(GEMMA3_27B)
    full = sum((i + 1) % 6 == 0 for i in range(62))
    per_position = 2 * (16 // tp) * 128 * 2  # k and v, the rank's KV heads, bf16
    want = ((62 - full) * (65 + 1) * 16 + full * (2048 + 1) * 16) * per_position
    c = next(c for c in candidates(cfg, tp) if c.name == f"dp 1 x tp {tp}")
    decode = estimate(cfg, c, "h100", Workload.decode(1, 32767))  # the step's token makes 32768 positions
    assert decode.bytes["kv_cache"] == decode.reads["kv_cache"] == want
    assert estimate(cfg, c, "h100", Workload.prefill(32768)).bytes["kv_cache"] == 62 * (2048 + 1) * 16 * per_position
    assert want < 62 * 32768 * per_position / 5  # a full-length cache per layer: over five times more


def test_a_cache_path_that_is_a_file_measures_and_warns_without_caching(tmp_path, monkeypatch, caplog):
    """FUNCTIONAL_NPU_CACHE naming a file: the profile is measured and used, one warning says why it is not kept
    (before: a raw NotADirectoryError after the measurement)."""
    import logging

    from functional_npu.runtime.planning import host_profile

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FUNCTIONAL_NPU_CACHE", str(tmp_path / "file"))
    figures = {"read_bytes_per_s": 1e10, "linear_bytes_per_s": 5e9, "flop_per_s": 1e11, "measured": {}}
    monkeypatch.setattr(host_profile, "_figures", lambda world, repeat: figures)
    with caplog.at_level(logging.WARNING, logger="functional_npu"):
        dev = host_profile.host_device(1)
    assert dev.memory_bytes_per_s == 5e9 and dev.flop_per_s == 1e11  # the measured figures, used
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "functional_npu"]
    assert warning == (
        f"host profile: measured, not cached: the cache directory {tmp_path / 'file' / 'host-profile'} cannot be "
        f"made: {tmp_path / 'file'} is not a directory; set FUNCTIONAL_NPU_CACHE to a writable directory"
    )


def _with_technique(e, name: str):
    """``e`` (an Estimate) as if its plan also used one more technique, every figure the same: no modelled gain."""
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.parallel.plan import Plan

    extra = {
        "layer sharding": {"layer_shard": layer_shard("o_proj", "dp")},
        "host memory": {"offload": "o_proj"},
        "EP": {"expert_axes": ("dp", "tp")},
    }[name]
    plan = dataclasses.replace(e.candidate.plan, **extra) if not isinstance(e.candidate.plan, dict) else None
    candidate = dataclasses.replace(e.candidate, name=f"{e.candidate.name} + {name}", plan=plan or Plan(**extra))
    return dataclasses.replace(e, candidate=candidate)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=st.sampled_from([DENSE, MOE, MLA]),
    mb=st.floats(0.5, 8.0),
    serve=st.booleans(),
    technique=st.sampled_from(["layer sharding", "host memory", "EP"]),
    at=st.integers(0, 40),
)
def test_a_technique_with_no_modelled_gain_never_changes_the_choice(cfg, mb, serve, technique, at):
    """The chosen plan plus a technique that models no better (the same figures), put anywhere in the ranking,
    first included: :func:`simplest` still picks the plan it picked."""
    from functional_npu.runtime.planning import simplest, techniques

    work = Workload.serve(32) if serve else Workload.decode(4, 32, F32)
    try:
        _, report = choose_plan(cfg, 4, "910b", mb * 1e6, work)
    except PlanDoesNotFit:
        return
    chosen = report.chosen
    if technique in techniques(chosen.candidate.plan):
        return
    twin = _with_technique(chosen, technique)
    ranked = list(report.ranked)
    ranked.insert(min(at, len(ranked)), twin)
    spread = device("910b").prediction_spread
    assert simplest(ranked, work, spread)[0] is chosen
    ranked.remove(twin)
    ranked.insert(0, twin)  # ranked first (a tie the sort may break either way)
    assert simplest(ranked, work, spread)[0] is chosen


def test_a_technique_is_kept_when_needed_to_fit_or_its_gain_beats_the_spread():
    """The rule that decided, in the report: on 910B at a budget only expert parallelism fits, EP is needed; with room
    for the plain split, EP is chosen only if it gains more than the spread, otherwise the plain plan is, and naming a
    larger spread turns a kept technique into the simpler choice."""
    from functional_npu.runtime.planning import simplest, techniques

    work = Workload.decode(4, 32, F32)
    plain_fits = None
    for mb in (0.5, 1, 2, 4, 8, 16, 64):
        try:
            _, report = choose_plan(MOE, 4, "910b", mb * 1e6, work)
        except PlanDoesNotFit:
            continue
        rule = report.rule
        have = techniques(report.chosen.candidate.plan)
        fitting = [e for e in report.ranked if e.fits]
        simpler = [e for e in fitting if techniques(e.candidate.plan) < have]
        if have and not simpler:
            assert rule.startswith("needed to fit: no plan without")
        elif have:
            assert rule.startswith("gain:") and "more than the model's spread (22%)" in rule
            # a spread above that gain: the simpler plan instead
            gain = float(rule.split(" by ")[1].split("%")[0]) / 100
            again, why = simplest(report.ranked, work, gain + 0.01)
            assert techniques(again.candidate.plan) < have and why.startswith("simplest:")
        else:
            assert rule.startswith(("the best plan uses no technique", "simplest:"))
            plain_fits = report
        assert "chosen by " + rule in report.why()
    assert plain_fits is not None


def test_a_profile_without_a_fixed_cost_warns_that_its_figures_are_the_roofline_only():
    bare = dataclasses.replace(DEVICES["h100-sxm"], step_overhead_s=None)
    with pytest.warns(UserWarning, match=r"no fixed cost per step .* roofline only"):
        choose_plan(DENSE, 2, bare, 1e9, WORK)
    fitted = estimate(DENSE, candidates(DENSE, 2)[0], "h100", WORK)
    assert fitted.parts["fixed_s"] == DEVICES["h100-sxm"].step_overhead_s  # added to every step
    assert estimate(DENSE, candidates(DENSE, 2)[0], bare, WORK).step_s == pytest.approx(
        fitted.step_s - fitted.parts["fixed_s"]
    )


def test_profiles_count_memory_in_the_devices_own_units():
    assert DEVICES["ascend-910b"].memory_bytes == 64 * 2**30 == DEVICES["ascend-910c"].memory_bytes
    assert DEVICES["h100-sxm"].memory_bytes == 80 * 2**30
    assert device("h200").name == "h200-sxm" and device("h200").memory_bytes > 140 * 2**30


def test_deployment_settings_are_priced():
    """FP8 weights read half the bf16 bytes; an FP8 cache holds half the KV; a speculative step computes its drafts
    beside its token and a serving workload counts the accepted ones; a paged cache at the mean context admits more
    sequences than one reserving every full context."""
    c = next(c for c in candidates(DENSE, 2) if c.name == "dp 1 x tp 2")
    base = Workload.decode(8, 64)
    bf16 = estimate(DENSE, c, "h100", base)
    fp8 = estimate(DENSE, c, "h100", base.with_(weights="fp8"))
    assert fp8.bytes["weights"] * 2 == bf16.bytes["weights"]
    kv8 = estimate(DENSE, c, "h100", base.with_(kv_dtype=torch.float8_e4m3fn))
    assert kv8.bytes["kv_cache"] * 2 == bf16.bytes["kv_cache"]
    mtp = estimate(DENSE, c, "h100", base.with_(draft_tokens=1, acceptance=0.7))
    assert mtp.parts["compute_s"] > 1.9 * bf16.parts["compute_s"]  # two tokens a sequence, the same weights read
    assert base.with_(draft_tokens=2, acceptance=0.5).tokens_per_step == pytest.approx(1 + 0.5 + 0.25)
    from functional_npu.runtime.planning import serve_estimate

    serve = Workload.serve(256, 0.25)
    plain = serve_estimate(DENSE, c, "h100", serve, memory_per_device=2e6)
    spec = serve_estimate(DENSE, c, "h100", serve.with_(draft_tokens=1, acceptance=1.0), memory_per_device=2e6)
    assert spec.batch <= plain.batch  # the verify step's activations take their room
    mean = serve_estimate(DENSE, c, "h100", serve.with_(admit="mean"), memory_per_device=2e6)
    assert mean.batch > plain.batch


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"acceptance": 1.5, "draft_tokens": 1}, r"acceptance .* must be in \[0, 1\], got 1.5"),
        ({"acceptance": -0.1, "draft_tokens": 1}, r"acceptance .* got -0.1"),
        ({"acceptance": True, "draft_tokens": 1}, r"acceptance .* got True"),
        ({"acceptance": 0.5}, r"acceptance=0.5 without draft_tokens"),
        ({"draft_tokens": -1}, r"draft_tokens .* got -1"),
        ({"weights": "int3"}, r"weights='int3' is not a format the planner prices"),
        ({"kv_dtype": "fp8"}, r"kv_dtype must be a torch dtype"),
        ({"admit": "mean"}, r"admit must be one of .* for a decode workload"),
    ],
)
def test_a_setting_the_planner_cannot_price_is_one_line_naming_the_field(settings, match):
    with pytest.raises(ValueError, match=match):
        Workload.decode(8, 64).with_(**settings)


@pytest.mark.parametrize(
    "field, settings", [("weights", {"weights": "fp8"}), ("kv_dtype", {"kv_dtype": torch.float8_e5m2})]
)
def test_a_format_the_device_does_not_run_is_refused_naming_the_field(field, settings):
    c = next(c for c in candidates(DENSE, 2) if c.name == "dp 1 x tp 2")
    with pytest.raises(ValueError, match=rf"workload: {field} 'fp8' is not a format ascend-910b runs"):
        estimate(DENSE, c, "910b", Workload.decode(8, 64).with_(**settings))
    with pytest.raises(ValueError, match=rf"^workload: {field} 'fp8' is not a format ascend-910b runs"):
        choose_plan(DENSE, 2, "910b", 1e9, Workload.serve(64).with_(**settings))


def test_experts_the_devices_do_not_divide_get_redundant_copies():
    """8 experts on 3 devices: the EP candidate holds 9 slots (one expert twice), as EPLB places 256 experts on 72
    devices; it is priced, not refused."""
    ep = [c for c in candidates(MOE, 3) if c.plan.expert_axes]
    assert ep and all(c.plan.num_slots == 9 and c.plan.max_copies == 2 for c in ep)
    e = estimate(MOE, ep[0], "910b", Workload.decode(3, 16, F32))
    assert e.bytes["weights"] > 0 and "all_gather" in e.parts
    assert all(c.plan.num_slots is None for c in candidates(MOE, 4) if c.plan.expert_axes)  # 4 divides 8
