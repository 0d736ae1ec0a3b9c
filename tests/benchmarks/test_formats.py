"""Weight formats: one model written four ways, and the table of a result."""

from benchmarks.formats import format_table


def test_formats_are_one_model_written_four_ways(tmp_path):
    """fp32, bf16, int8 and int4 of the same seeded weights; the bytes a decode token reads shrink with the format
    (every linear layer quantized, lm_head included)."""
    import dataclasses

    from benchmarks.configs import QUICK
    from benchmarks.formats import FORMATS, decode_bytes, write_formats
    from functional_npu import Mesh
    from functional_npu.models.linear import prepare_params
    from functional_npu.runtime.checkpoint import load_checkpoint

    cfg = dataclasses.replace(QUICK, num_layers=1, vocab_size=512)
    paths = write_formats(cfg, tmp_path)
    mesh = Mesh.abstract({"tp": 1}, 0)
    sizes = {}
    for name, path in paths.items():
        params = prepare_params(load_checkpoint(path, mesh))
        assert params["embed"].dtype == FORMATS[name][0]
        assert ("quant" in params) == (FORMATS[name][1] is not None)
        sizes[name] = decode_bytes(params)
    assert sizes["fp32"] > 1.9 * sizes["bf16"] > 1.9 * 1.8 * sizes["int8"] > 1.9 * 1.8 * 1.6 * sizes["int4"]


def test_format_table_has_medians_spread_and_peers():
    res = {
        "formats": {
            "int8": {
                "1": {
                    "tok_s": 300.0,
                    "share_of_roofline": 0.8,
                    "vs_our_fp32": 3.0,
                    "peer": "torchao_int8",
                    "vs_peer": 1.5,
                }
            }
        },
        "systems": {
            "fnpu_int8": {"1": {"median": 300.0, "min": 290.0, "max": 310.0}},
            "torchao_int8": {"1": {"median": 200.0, "min": 190.0, "max": 210.0}},
        },
        "skipped": {"torchao_int4": "torchao int4 weight-only does not run on this CPU"},
    }
    table = format_table(res)
    assert "| int8 | 1 | 300.0 (290.0-310.0) | 80% | 3.00x | torchao_int8 | 200.0 (190.0-210.0) | 1.50x |" in table
    assert "torchao_int4: torchao int4 weight-only does not run on this CPU" in table
