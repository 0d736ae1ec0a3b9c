"""The command line as a user runs it: the README demo, generate (local dp x tp ranks, --json, tokenizer),
bad arguments."""

import json
import re

import pytest

from ..support.cli import PROMPTS, cli, generate_json, refused
from ..support.hf_models import hf_greedy, save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen2 checkpoint with a word-level tokenizer, and transformers' greedy tokens for two prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("qwen2")
    hf = save_tiny("qwen2", path, 3)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    prompts = PROMPTS[:2]
    return path, prompts, [hf_greedy(hf, p, 6) for p in prompts]


def test_demo_runs_and_verifies():
    out = cli("demo", "--tp", "2", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo: OK" in out.stdout
    assert out.stdout.count("| True |") == 5  # eager and compiled on 1 and 2 ranks, compiled layer-sharded dp 2
    # each compiled run is set beside the eager run at the same rank count
    assert re.search(r"\| [\d.]+x eager on 1 rank: what compiling buys \|", out.stdout), out.stdout
    assert re.search(r"\| [\d.]+x eager at tp = 2: the compiled graph holds the collectives \|", out.stdout)
    _check_layer_sharding_saves(out.stdout)
    # the emulated link is the prefetch benchmark's (tests/benchmarks/test_emulated_link.py): the demo names it
    assert "python -m benchmarks prefetch" in out.stdout
    # the serving stream: both systems' served tokens/s, their ratio, and how many requests agree
    assert re.search(r"\| engine \(continuous batching, paged KV, 4 at once\) \| [\d.]+ served tokens/s \|", out.stdout)
    assert re.search(r"\| lockstep generate \(4 at a time, each batch to its longest\) \| [\d.]+ served", out.stdout)
    assert re.search(r"the engine serves [\d.]+x lockstep's tokens/s; \d+ of 16 requests have", out.stdout)


def _check_layer_sharding_saves(stdout):
    """The layer-sharded line's replicated bytes are the demo model's o_proj and down tensors, counted here; the
    rank holds fewer (its layers and the ring), and the saving printed is the difference."""
    from functional_npu.cli.demo import DEMO_CONFIG, DEMO_MODEL

    line = re.search(
        r"layer-sharded: each rank holds (\d+) KiB of o_proj,down_proj .* instead of (\d+) KiB replicated \((\d+)%\), "
        r"saving (\d+) KiB for (\d+) broadcasts per step",
        stdout,
    )
    assert line, stdout
    held, replicated, share, saved, broadcasts = map(int, line.groups())
    layers = DEMO_MODEL.abstract_params(DEMO_CONFIG)["layers"]
    assert replicated * 2**10 == sum(layer[leaf].nbytes for layer in layers for leaf in ("o_proj", "down"))
    assert held < replicated and saved == replicated - held and share == round(100 * held / replicated)
    assert broadcasts == DEMO_CONFIG.num_layers  # one per layer and step


def test_generate_dp2_json_in_prompt_order(model):
    path, prompts, ref = model
    result = generate_json(path, prompts, "--dp", "2", "--backend", "eager", "--max-new-tokens", "6")
    assert result["token_ids"] == ref
    assert len(result["text"]) == 2 and {"load_s", "compile_s", "generate_s"} <= set(result["timings"])


def test_generate_cache_dir_saves_each_ranks_graphs_and_loads_them(model, tmp_path):
    """--cache-dir: each rank saves its prefill and greedy decode graphs under its coordinate; the next run loads
    them (the files the first run published stay the same files) and gives the same tokens."""
    path, prompts, ref = model
    args = ("--tp", "2", "--backend", "aot_eager", "--cache-dir", str(tmp_path), "--max-new-tokens", "6")
    assert generate_json(path, prompts, *args)["token_ids"] == ref
    graphs = {p: p.stat().st_ino for p in tmp_path.glob("*/*/*/graph.bin")}
    assert sorted({p.parent.name for p in graphs}) == ["forward-2x16-last", "greedy-2x1"]
    assert sorted({p.parts[-4] for p in graphs}) == ["dp0of1-tp0of2", "dp0of1-tp1of2"] and len(graphs) == 4
    assert generate_json(path, prompts, *args)["token_ids"] == ref
    assert {p: p.stat().st_ino for p in tmp_path.glob("*/*/*/graph.bin")} == graphs  # loaded, none rebuilt


def test_loading_and_compiling_bars_on_rank_0(model, capsys):
    """A bar for loading and one for compiling the job's prefill and decode graphs (on rank 0; the CLI shows them
    on a terminal and never under --json), and the same tokens after the warm-up."""
    from functional_npu.cli.runner import generate_on_rank
    from functional_npu.runtime.launch import RankContext

    path, prompts, ref = model
    out = generate_on_rank(RankContext(0, 1), str(path), {"dp": 1, "tp": 1}, prompts, 6, backend="eager", progress=True)
    err = capsys.readouterr().err
    assert out["tokens"] == ref and out["timings"]["compile_s"] > 0
    assert re.search(r"loading \S+: 100%\|.*\| \d+/\d+ ", err)
    assert re.search(r"compiling: 100%\|.*\| 2/2 .*decode", err)


def test_generate_with_tokenizer_text(model):
    path, _, ref = model
    result = generate_json(path, [], "--tp", "2", "--backend", "none", "--prompt", "w5 w6 w7", "--max-new-tokens", "6")
    assert result["token_ids"] == [ref[0]]
    assert result["text"][0].split() == [f"w{i}" for i in ref[0]]


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--tp", "3"], "--tp 3: the demo model has 4 heads; use 1, 2 or 4 ranks"),
        (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive integer, got 0"),
        (
            ["generate", "--model", "/nonexistent", "--prompt-ids", "1", "--max-new-tokens", "2"],
            "config.json not found",
        ),
        (
            ["generate", "--model", "MODEL", "--tp", "3", "--prompt-ids", "1", "--max-new-tokens", "2"],
            "cannot shard this Qwen2ForCausalLM config",
        ),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1,x", "--max-new-tokens", "2"],
            "expected comma-separated token ids like 1,2,3, got '1,x'",
        ),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1,500", "--max-new-tokens", "2"],
            "generate: prompt 0 has token ids [500] outside the vocabulary [0, 128)",
        ),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1", "--max-new-tokens", "2", "--timeout", "-5"],
            "argument --timeout: expected a positive number of seconds, got -5",
        ),
        (["demo", "--timeout", "nan"], "argument --timeout: expected a finite number of seconds, got nan"),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1,2", "--max-new-tokens", "100000"],
            "exceed the model's 256 positions (max_position_embeddings); lower --max-new-tokens to at most 254 or "
            "shorten the prompt",
        ),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1", "--max-new-tokens", "2", "--backend", "tvm"],
            "invalid choice: 'tvm'",
        ),
        (
            ["generate", "--model", "MODEL", "--max-new-tokens", "2"],
            "one of the arguments --prompt --prompt-ids is required",
        ),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1", "--max-new-tokens", "2", "--mode", "max-speed"],
            "mode 'max-speed': backend 'inductor' on 'cpu' has the modes default, reduce-overhead, max-autotune, "
            "max-autotune-no-cudagraphs (or none: the one measured fastest there)",
        ),
        (
            ["generate", "--model", "MODEL", "--prompt-ids", "1", "--max-new-tokens", "2", "--backend", "none"]
            + ["--mode", "default"],
            "mode 'default': backend 'none' on 'cpu' takes no mode",
        ),
        (["nonsense"], "invalid choice: 'nonsense'"),
        (  # options the post-training round does not use: once silently ignored, and its unused --tp refused
            ["demo", "--post-train", "--quant", "int4", "--tp", "3"],
            "demo --post-train runs one fixed round on 2 ranks; it takes no --tp, --quant (drop them)",
        ),
    ],
)
def test_bad_arguments_are_one_clear_line_and_exit_2(model, args, message, capsys):
    """In this process (the parser is the one ``python -m functional_npu`` runs; a fresh process per case only
    cost the suite its start-up)."""
    refused([str(model[0]) if a == "MODEL" else a for a in args], message, capsys)


def test_the_module_entry_point_refuses_in_one_line():
    out = cli("generate", "--model", "/nonexistent", "--prompt-ids", "1", "--max-new-tokens", "2", timeout=120)
    assert out.returncode == 2 and "config.json not found" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (  # the prompt alone fills the positions: the advice is the prompt's length, not --max-new-tokens 0
            ["--prompt-ids", ",".join(["1"] * 300), "--max-new-tokens", "2"],
            "300 prompt tokens + 2 new exceed the model's 256 positions (max_position_embeddings); shorten the prompt "
            "to at most 254 tokens",
        ),
        (
            ["--prompt-ids", ",".join(["1"] * 300), "--max-new-tokens", "300"],
            "shorten the prompt and lower --max-new-tokens to at most 256 together",
        ),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "nan"],
            "sampling: --temperature must be 0 (greedy) or a finite number >= 1e-06 (below it the scaled logits "
            "overflow), got nan",
        ),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "1", "--top-p", "nan"],
            "sampling: --top-p must be a number in (0, 1] (None: no cut), got nan",
        ),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "1", "--seed", str(2**70)],
            f"sampling: --seed must be an int in [0, 2**64) (torch's generator range), got {2**70}",
        ),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "1", "--seed", "-1"],
            "sampling: --seed must be an int in [0, 2**64)",
        ),
        (  # options that do not apply: once silently ignored
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--top-k", "5", "--seed", "3"],
            "--top-k, --seed: greedy decoding (--temperature 0, the default) does not sample; pass --temperature > 0 "
            "to sample, or drop them",
        ),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--backend", "none", "--cache-dir", "/nonexistent"],
            "--cache-dir saves compiled graphs, but --backend none compiles nothing; drop one of them",
        ),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--layer-shard-axis", "tp"],
            "--layer-shard-axis needs --layer-shard (which weight series to spread over the axis)",
        ),
        (["--prompt-ids", "1", "--max-new-tokens", "2", "--cache-dir", ""], "--cache-dir: expected a directory"),
        (  # once a NotImplementedError after a 40 s compile
            ["--prompt-ids", "1", "--max-new-tokens", "2", "--tp", "2", "--mode", "reduce-overhead"],
            "--mode reduce-overhead on the CPU is inductor's C++ wrapper, which cannot compile the collectives of 2 "
            "ranks; use --mode default",
        ),
    ],
)
def test_settings_a_rank_would_trip_on_are_refused_before_ranks_start(model, args, message, capsys):
    """Checked in this process, before any rank starts (they once failed inside the ranks, or advised
    --max-new-tokens 0)."""
    refused(["generate", "--model", str(model[0]), *args], message, capsys)


@pytest.mark.parametrize("gone", ["bench", "graphs"])
def test_the_package_runs_models_only(gone, capsys):
    """demo, plan, serve and generate; the benchmarks and the golden graphs are the repository's (python -m benchmarks
    bench, python -m tools.graphs)."""
    from functional_npu.cli import build_parser

    refused([gone], f"invalid choice: '{gone}'", capsys)
    assert "{demo,plan,serve,generate}" in build_parser().format_usage()


def test_a_prompt_filling_the_positions_but_one_generates_its_one_token(model):
    """255 prompt tokens and --max-new-tokens 1 on a 256-position model: the warm-up once generated 2 tokens and the
    rank refused its own run."""
    result = generate_json(model[0], [[1] * 255], "--backend", "eager", "--max-new-tokens", "1")
    assert len(result["token_ids"][0]) == 1


def test_prompt_text_without_tokenizer_is_a_clear_error(model, tmp_path):
    import shutil

    bare = shutil.copytree(model[0], tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    out = cli("generate", "--model", str(bare), "--prompt", "hello", "--max-new-tokens", "2", timeout=120)
    assert out.returncode == 2 and "--prompt needs" in out.stderr and "pass --prompt-ids instead" in out.stderr


def test_a_broken_tokenizer_matters_only_where_it_is_needed(model, tmp_path):
    import shutil

    path, prompts, ref = model
    broken = shutil.copytree(path, tmp_path / "broken_tok")
    (broken / "tokenizer.json").write_text("{not json")
    ids = ",".join(map(str, prompts[0]))
    argv = ["generate", "--model", str(broken), "--backend", "none", "--prompt-ids", ids, "--max-new-tokens", "6"]
    out = cli(*argv, "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == [ref[0]]
    assert f"{broken / 'tokenizer.json'} cannot be read" in out.stderr and "Traceback" not in out.stderr
    out = cli("generate", "--model", str(broken), "--prompt", "w5", "--max-new-tokens", "2", timeout=120)
    assert out.returncode == 2 and "tokenizer.json cannot be read" in out.stderr, out.stderr
    assert "pass --prompt-ids instead" in out.stderr and "Traceback" not in out.stderr


def test_an_error_raised_on_a_rank_reaches_the_command_line_whole(model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(model[0], tmp_path / "missing_tensor")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    out = cli("generate", "--model", str(broken), "--backend", "none", "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert out.returncode == 1, out.stderr
    assert "error: rank 0 raised ValueError: " in out.stderr
    assert "does not match its Qwen2ForCausalLM config.json:" in out.stderr
    assert "missing tensors (1): model.layers.1.mlp.up_proj.weight" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    """The tiny Qwen2 model as a compressed-tensors int4 checkpoint (groups of 32), written by save_checkpoint."""
    from functional_npu import Mesh, Quant, load_checkpoint
    from functional_npu.runtime.loading.save import save_checkpoint

    float_dir = tmp_path_factory.mktemp("qwen2-float")
    save_tiny("qwen2", float_dir, 3)
    full = load_checkpoint(float_dir, Mesh.abstract({"tp": 1}, 0))
    return save_checkpoint(full, tmp_path_factory.mktemp("qwen2-int4"), quant=Quant(4, "group", group_size=32))


def test_generate_quantized_checkpoint_in_any_dtype(int4_model):
    """generate --model on a quantized checkpoint, as stored (fp32 scales) and with --dtype bfloat16."""
    prompts = PROMPTS[:2]
    stored = generate_json(int4_model, prompts, "--backend", "none", "--max-new-tokens", "4")
    cast = generate_json(int4_model, prompts, "--backend", "none", "--max-new-tokens", "4", "--dtype", "bfloat16")
    assert [len(t) for t in stored["token_ids"]] == [len(t) for t in cast["token_ids"]] == [4, 4]


def test_generate_refuses_a_tp_that_cuts_a_quantization_group(int4_model, capsys):
    """intermediate 96 holds 3 groups of 32 along down_proj's input: tp 2 would cut one; refused before any rank."""
    from functional_npu.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(int4_model), "--tp", "2", "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "3 groups of 32" in err and "'tp' (size 2)" in err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1
