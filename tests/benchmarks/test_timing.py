"""Interleaved rounds and their arithmetic, timed on a fake clock (no sleeps)."""

from benchmarks.timing import best_time, generate_times, interleaved, rates, ratio, rounds, stats


class FakeClock:
    """A clock that only moves when a timed call says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_best_time_is_the_fastest_run():
    clock, took = FakeClock(), iter([0.75, 0.25, 0.5])

    def fn():
        clock.now += next(took)

    assert best_time(fn, 3, clock=clock) == 0.25
    assert next(took, None) is None  # fn ran exactly repeat times


def test_rates_separate_decode_from_prefill():
    """1 new token is prefill only (best 0.5 s for 10 prompt tokens); 8 more decode steps add 0.25 s."""
    clock = FakeClock()
    took = {1: iter([0.625, 0.5]), 9: iter([0.75, 1.0])}

    def run(b, n):
        clock.now += next(took[n])

    decode, prefill = rates(run, 1, new=9, prompt_len=10, clock=clock)
    assert (decode, prefill) == (8 / 0.25, 10 / 0.5)
    assert all(next(t, None) is None for t in took.values())


def test_generate_times_time_n_then_1_new_token_once_each():
    clock, calls = FakeClock(), []

    def run(n):
        calls.append(n)
        clock.now += {9: 1.0, 1: 0.25}[n]

    assert generate_times(run, 9, clock=clock) == (1.0, 0.25) and calls == [9, 1]


def test_systems_run_interleaved_round_by_round():
    """A B A B: every round runs each system once per batch before the next round starts."""
    calls = []
    systems = {s: (lambda b, n, s=s: calls.append((s, b))) for s in "AB"}
    out = interleaved(systems, (1, 8), new=3, prompt_len=4, repeat=3, between=lambda r: calls.append(("round", r)))
    per_round = [("A", 1)] * 4 + [("A", 8)] * 4 + [("B", 1)] * 4 + [("B", 8)] * 4
    assert calls == (per_round + [("round", 0)]) + (per_round + [("round", 1)]) + (per_round + [("round", 2)])
    assert all(len(out[s][b]["decode"]) == 3 for s in "AB" for b in (1, 8))


def test_rounds_keep_each_systems_results_after_the_untimed_ones():
    """Warm-up rounds run every system in the same order but keep nothing, and ``between`` counts timed rounds."""
    calls, seen = [], []
    systems = {s: (lambda s=s: calls.append(s) or len(calls)) for s in "AB"}
    out = rounds(systems, 2, warmup=1, between=seen.append)
    assert calls == list("ABABAB") and seen == [0, 1]
    assert out == {"A": [3, 5], "B": [4, 6]}  # the results of rounds 2 and 3 only


def test_stats_and_ratio_per_round():
    assert stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert ratio([2.0, 6.0, 3.0], [1.0, 2.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}  # round by round
