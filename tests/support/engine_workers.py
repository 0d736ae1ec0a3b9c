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


def served_by_replicas(ctx, model_dir: str, axes: dict, plan: dict, prompts, new, replicas: str) -> dict | None:
    """Every rank: the model under ``plan`` on ``axes``; each prompt generated alone on one rank of its own (a model
    loaded without the plan, on a mesh of one: the reference counted apart), then the requests through a lockstep
    engine with ``replicas``, and again through one without (every rank runs rank 0's batch). Rank 0 returns the
    tokens, the replica of each request, the steps each engine took and whether every pool ended empty."""
    from functional_npu import Mesh, Plan, compile_model, load_checkpoint
    from functional_npu.runtime.serving import Engine, Request

    mesh = ctx.mesh(axes)
    shapes = dict(batch_sizes=[1, 2], max_seq_len=48, prefill_lengths=[8])
    one = Mesh.abstract({"tp": 1}, 0)
    single = compile_model(load_checkpoint(model_dir, one), one, backend="none", **shapes | {"prefill_lengths": [16]})
    alone = [single.generate([p], n)[0] for p, n in zip(prompts, new)]
    model = compile_model(load_checkpoint(model_dir, mesh, Plan(**plan)), mesh, backend="none", **shapes)
    requests = [Request(tuple(p), n, stop=()) for p, n in zip(prompts, new)]
    out: dict = {"alone": alone}
    for name, kw in (("replicas", {"replicas": replicas}), ("one_batch", {})):
        engine = Engine(model, blocks=40, block_size=4, chunk=8, lockstep=True, **kw)
        if ctx.rank != 0:
            engine.follow()
            continue
        got: dict = {}
        for i, r in enumerate(requests):
            engine.add(r, i)
        where = [engine.replica_of(i) for i in range(len(requests))]
        steps = 0
        while engine.has_work():
            for event in engine.step():
                got.setdefault(event.id, []).extend(event.tokens)
            steps += 1
        engine.close()
        out[name] = {"served": [got[i] for i in range(len(requests))], "steps": steps, "replica": where,
                     "free": all(e.pool.used == 0 for e in engine._engines())}  # fmt: skip
    return out if ctx.rank == 0 else None
