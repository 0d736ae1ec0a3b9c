"""The serving benchmark's workload and stop ids, counted here: prompt lengths in [16, 512], target lengths of 16 and
more capped at the cap, and a stop id that ends each request at its target or at the first earlier place its token
comes up."""

from benchmarks.bench_serve import _stops, serve_table, workload


def test_the_workload_is_seeded_and_in_its_ranges():
    prompts, targets = workload(64, 1000, 160, seed=3)
    assert (prompts, targets) == workload(64, 1000, 160, seed=3)
    assert len(prompts) == 64 and all(16 <= len(p) <= 512 for p in prompts)
    assert all(0 < t < 1000 for p in prompts for t in p)
    assert all(16 <= t <= 160 for t in targets) and len(set(targets)) > 10


def test_a_stop_id_ends_a_request_at_its_target_or_earlier():
    reference = [[5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 1, 2]]
    stops, served = _stops(reference, [3, 4, 3])
    assert stops == [7, 9, 1] and served == [3, 1, 1]


def test_the_table_has_a_row_per_system():
    run = {"tokens_per_s": 10.0, "ttft_s": {"p50": 0.5, "p99": 1.0}, "tpot_s": {"p50": 0.01, "p99": 0.02}}
    out = {"tokens_per_s": {"engine": {"median": 10.0, "min": 9.0, "max": 11.0}}, "runs": {"engine": [run]}}
    assert "| engine | 10.0 (9.0-11.0) | 0.50 / 1.00 | 10.0 / 20.0 |" in serve_table(out)
