"""The warm-start benchmark's report (real timings come from `python -m benchmarks warm_start`, never asserted; that a
fresh process loads every graph is tests/runtime/test_compile_cache.py's)."""

from benchmarks.warm_start import METHOD, report

OUT = {
    "cold_s": [60.0, 50.0],
    "warm_s": [4.5, 5.0],
    "ratio": [0.075, 0.1],
    "warm_steady_generate_s": [0.5, 0.6],
    "cold_wall_s": [63.0, 53.0],
    "warm_wall_s": [7.0, 7.5],
    "wall_ratio": [7.0 / 63.0, 7.5 / 53.0],
    "same_tokens": True,
    "warm_loaded_everything": True,
    "graphs": ["forward-1x32", "forward-1x1"],
    "method": METHOD,
}


def test_report_is_a_row_per_pair_and_says_what_the_warm_processes_did():
    lines = report(OUT).splitlines()
    assert lines[0].startswith("| pair | cold s | warm s | warm / cold | of which generating |")
    assert lines[2] == "| 1 | 60.0 | 4.50 | 7.5% | 0.50 | 63.0 | 7.00 | 11.1% |"
    assert lines[3] == "| 2 | 50.0 | 5.00 | 10.0% | 0.60 | 53.0 | 7.50 | 14.2% |"
    assert lines[-1] == (
        "graphs: forward-1x32, forward-1x1; same tokens cold and warm: True; every warm process loaded all its "
        "graphs and compiled none: True"
    )
