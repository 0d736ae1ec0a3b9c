"""Rank functions for the engine's lockstep tests (tests/runtime/test_engine_lockstep.py)."""


def served_in_lockstep(ctx, model_dir: str, axes: dict, plan: dict, prompts, new) -> dict | None:
    """Every rank: the model under ``plan`` on ``axes``, each prompt generated alone (lockstep ``generate``, every
    rank), then the same requests through one lockstep engine (rank 0 schedules, the others follow). Rank 0 returns
    both; the others None."""
    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.runtime.serving import Engine, Request

    mesh = ctx.mesh(axes)
    shapes = dict(batch_sizes=[1, 2, 4], max_seq_len=48, prefill_lengths=[8, 16, 32])
    model = compile_model(load_checkpoint(model_dir, mesh, Plan(**plan)), mesh, backend="none", **shapes)
    alone = [model.generate([p], n)[0] for p, n in zip(prompts, new)]
    engine = Engine(model, blocks=30, block_size=4, chunk=8, lockstep=True)
    if ctx.rank != 0:
        engine.follow()
        return None
    got: dict = {}
    for event in engine.run([Request(tuple(p), n, stop=()) for p, n in zip(prompts, new)]):
        got.setdefault(event.id, []).extend(event.tokens)
    engine.close()
    return {"alone": alone, "served": [got[i] for i in range(len(prompts))], "free": engine.pool.used == 0}
