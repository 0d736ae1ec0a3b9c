"""Where layer sharding pays, on paper: the cost model's table over published device figures."""

from benchmarks.prefetch_paper import WORKLOADS, paper_rows, paper_table


def test_paper_table_rows_follow_the_model():
    """The published-figures table: every row's k and exposure come from the cost model; prefill hides the
    broadcast where decode on a 910B's HCCS link cannot (the reason vllm-ascend keeps it to prefill nodes)."""
    rows = paper_rows()
    assert len(rows) == len(WORKLOADS) and paper_table(rows).count("\n") == len(rows) + 1
    for w, r in zip(WORKLOADS, rows):
        assert 1 <= r["k"] <= w.layers - 2 and 0 <= r["exposed"] <= 1 and r["saved_gb"] > 0
        if w.tokens >= 4096:
            assert r["k"] == 1 and r["exposed"] == 0
    ds = [r for r in rows if r["model"] == "DeepSeek-V3" and r["tokens"] == 64][0]
    assert ds["broadcast_ms"] > 5 * ds["compute_ms"] and ds["exposed"] > 0.5
