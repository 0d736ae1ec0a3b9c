"""Rank jobs for module-TP tests: one world runs several plans of one checkpoint."""

import torch


def module_tp_generate(
    ctx, model_dir: str, dp: int, tp: int, plans, prompts, new: int, *, backend="none", series=None, k=0
):
    """For each plan (module -> size): load with ``dp`` split for it (``layer_shard`` the ``series`` over the
    outer dp, fetched ``k`` ahead), then on this rank's prompts (dealt by dp index, in lockstep):
    a dict of the prompt indices, each prompt's prefill logits ``[len, V]``, the greedy tokens (generate, decoding
    through the greedy head),
    the greedy head's tokens over the prefill (``decode(greedy=True)``), bytes read and local shapes."""
    from functional_npu import Plan, compile_model, flatten_with_paths, load_checkpoint, split_dp
    from functional_npu.models import family_of
    from functional_npu.models.decoder import decode
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.parallel.module_tp import dp_axes
    from functional_npu.parallel.prefetch import drain
    from functional_npu.runtime.serving.generate import Lockstep

    out = []
    for sizes in plans:
        axes, plan = split_dp({"dp": dp, "tp": tp}, sizes)
        mesh = ctx.mesh(axes)
        read: list[int] = []
        ls = layer_shard(series, "dp") if series else None
        plan = Plan(module_tp=plan, layer_shard=ls, prefetch_step=k)
        params = load_checkpoint(model_dir, mesh, plan, on_read=lambda _, n: read.append(n))
        d = dp_axes(mesh)
        mine = list(range(mesh.axis_index(d), len(prompts), mesh.axis_size(d)))
        rows, width = [prompts[i] for i in mine], max(len(p) for p in prompts)
        model = compile_model(
            params,
            mesh,
            backend=backend,
            batch_sizes=[len(rows)],
            max_seq_len=width + new,
            prefill_lengths=[width],
            greedy_head=True,  # decode steps through the argmax head: (max, index) pairs cross the ranks
        )
        lock = Lockstep.over(len(prompts), mesh.axis_size(d), width, model.batch_sizes)
        tokens = model.generate(rows, new, lockstep=lock)
        result = {"indices": mine, "tokens": tokens, "read": sum(read), "axes": axes}
        leaves = flatten_with_paths(params)  # what a rank must read: its shards, not the computed expert map
        result["shapes"] = {p: tuple(x.shape) for p, x in leaves}
        result["bytes"] = sum(x.numel() * x.element_size() for p, x in leaves if not p.endswith("expert_map"))
        cfg = params.config
        result["full"] = {p: tuple(x.shape) for p, x in flatten_with_paths(family_of(cfg).abstract_params(cfg, plan))}
        if backend == "none":  # the whole prefill's logits, and the greedy head over it
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for i, p in enumerate(rows):
                ids[i, : len(p)] = torch.tensor(p)
            cfg, pos = model.config, torch.arange(width).expand(len(rows), width)
            blocks = family_of(cfg).blocks(cfg, model.plan)
            with torch.no_grad():
                for greedy in (False, True):
                    state = model.new_state(len(rows))
                    y = decode(model.params, ids, pos, state, mesh, blocks=blocks, plan=model.plan, greedy=greedy)
                    drain(state.prefetched)
                    result["argmax" if greedy else "logits"] = y
        out.append(result)
    return out


def check_every_module_over_dp2(world2, reference, new: int) -> None:
    """o_proj, the dense MLP, the embedding and lm_head of ``reference``'s model (an ``hf_references`` entry) TP'd
    over both ranks of ``world2`` (tp 1), two prompts per rank: each prompt's prefill logits (1e-4) and ``new``
    greedy tokens as transformers', and each rank read only its shards."""
    path, prompts, ref_logits, ref_tokens = reference
    plans = [dict.fromkeys(("o_proj", "mlp", "embed", "lm_head"), 2)]
    four = prompts + prompts[:1]  # two per rank: the ranks of a group step with the same shapes
    for (r,) in world2.run(module_tp_generate, path, 2, 1, plans, four, new):
        assert r["read"] == r["bytes"]
        for j, i in enumerate(r["indices"]):
            ref = i % len(prompts)
            assert (r["logits"][j, : len(four[i])] - ref_logits[ref]).abs().max().item() < 1e-4
            assert r["tokens"][j] == ref_tokens[ref]
