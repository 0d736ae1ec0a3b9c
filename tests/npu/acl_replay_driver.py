"""The npugraph_ex runs ``tests/npu/test_acl_replay.py`` checks, in one process of their own (npugraph_ex on stand-ins
changes the import system): ``python -m tests.npu.acl_replay_driver SOURCES OUT``, started by
:func:`tools.conversion.run_conversion`; the JSON written to ``OUT`` holds each result.

- ``golden``: the layer-sharded k = 2 decode case replayed :data:`GOLDEN_STEPS` times;
- ``turning`` / ``still``: a ring of three buffers the function writes in place and turns each call, as
  ``prefetch.turn`` turns the ring between steps (the planted address change), and the same ring unturned;
- ``limited``: the turning ring under ``capture_limit=1``;
- ``unsafe_skip`` / ``forced``: the turning ring with ``unsafe_skip_npugraph_capture_validation`` and the still one with
  ``force_recapture``, in npugraph_ex's own ``CompilerConfig`` (what the options ``npugraph_ex_config`` refuses do);
- ``relaxed``: the still ring under npugraph_ex's own config with ``capture_error_mode="relaxed"`` (the mode reaches
  the capture: what ``npugraph_ex_config`` refuses);
- ``refused``: the one-line refusal of each refused option by ``npugraph_ex_config``, and the options it accepts;
- ``copies_ring`` / ``copies_unordered``: :func:`functional_npu.npu.capture_checks.copies` on the graph npugraph_ex
  hands to capture for a ring slot written by its broadcast, on the capture stream, and on a side stream with no
  events (npugraph_ex then clones the slot);
- ``no_inplace_ring`` / ``no_inplace_bump``: with ``input_inplace_pass`` off, what npugraph_ex raises for the ring
  slot's broadcast, and the graph's ops and copy check for an in-place add into an input.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

GOLDEN = "qwen3-dp2-layer_shard-k2-decode"
GOLDEN_STEPS = 4
ARG_NAMES = ("params", "tokens", "positions", "state", "mesh", "last")  # the forward's arguments
STEPS = 4


def _turning(ring: list[Any], x: Any) -> Any:
    ring[0].add_(x)
    ring[:] = ring[1:] + ring[:1]
    return x * 2


def _still(ring: list[Any], x: Any) -> Any:
    ring[0].add_(x)
    return x * 2


def _ring_write(slot: Any, part: Any, x: Any, *, mesh: Any, side: Any = None) -> Any:
    """One ring slot written in place by its broadcast (on the ``side`` stream scope: no events), then read."""
    import contextlib

    import torch.distributed._functional_collectives as funcol

    from functional_npu.core import broadcast_into

    with side("prefetch") if side is not None else contextlib.nullcontext():
        broadcast_into(slot, [part], mesh, "dp", src=0, after=x)
    return funcol.wait_tensor(slot).sum() + x.sum()


def _bump(buf: Any, x: Any) -> Any:
    buf.add_(x)
    return buf.sum()


def _ring() -> tuple[list[Any], Any]:
    import torch

    return [torch.zeros(8) for _ in range(3)], torch.ones(8)


def _golden() -> tuple[dict[str, Any], Any]:
    """The golden case's replay, and its mesh (rank 0 of a fake process group, left up)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from functional_npu.npu import acl_replay
    from functional_npu.parallel import prefetch
    from functional_npu.runtime import RankContext
    from functional_npu.runtime.serving import npugraph_ex_config, npugraph_ex_streams
    from tools.aten_graphs import CASES, case_function, case_mesh

    case = next(c for c in CASES if c.name == GOLDEN)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.world)
    mesh = case_mesh(case, RankContext(0, case.world))
    mesh.init_groups()
    fn, args = case_function(case, mesh, streams=npugraph_ex_streams())
    got = acl_replay.replay(fn, args, npugraph_ex_config(), GOLDEN_STEPS, names=ARG_NAMES)
    prefetch.drain(args[3].prefetched)
    return got, mesh


def main(argv: list[str]) -> int:
    from functional_npu.npu import acl_graph, acl_replay, capture_checks

    acl_replay.install(Path(argv[0]))
    import npugraph_ex  # type: ignore[import-not-found]
    import torch

    from functional_npu.runtime.serving import npugraph_ex_config

    golden, mesh = _golden()
    out: dict[str, Any] = {"golden": golden}
    names = ("ring", "x")
    out["turning"] = acl_replay.replay(_turning, _ring(), npugraph_ex_config(), STEPS, names=names)
    out["still"] = acl_replay.replay(_still, _ring(), npugraph_ex_config(), STEPS, names=names)

    def raw(**options: Any) -> Any:
        config = npugraph_ex.CompilerConfig()
        for name, value in options.items():
            setattr(config, name, value)
        return config

    out["unsafe_skip"] = acl_replay.replay(
        _turning, _ring(), raw(unsafe_skip_npugraph_capture_validation=True), STEPS, names=names
    )
    out["limited"] = acl_replay.replay(_turning, _ring(), npugraph_ex_config(capture_limit=1), STEPS, names=names)
    out["forced"] = acl_replay.replay(_still, _ring(), raw(force_recapture=True), STEPS, names=names)
    out["relaxed"] = acl_replay.replay(_still, _ring(), raw(capture_error_mode="relaxed"), STEPS, names=names)
    refused = {}
    for name, value in (
        ("unsafe_skip_npugraph_capture_validation", True),
        ("force_recapture", True),
        ("input_inplace_pass", False),
        ("capture_error_mode", "relaxed"),
        ("capture_error_mode", "thread_local"),
    ):
        try:
            npugraph_ex_config(**{name: value})
        except ValueError as e:
            refused[f"{name}={value}"] = str(e)
    accepted = {"clone_input": False, "capture_limit": 8, "deadlock_check": True, "clone_output": True}
    npugraph_ex_config(**accepted)
    out["refused"] = {"refused": refused, "accepted": sorted(accepted)}
    write = functools.partial(_ring_write, mesh=mesh)
    unordered = functools.partial(_ring_write, mesh=mesh, side=acl_graph.unordered_streams().side)
    ring_args = (torch.zeros(8), torch.ones(8), torch.ones(8))
    out["copies_ring"] = capture_checks.copies(acl_graph.capture(write, ring_args, npugraph_ex_config())["gm"])
    out["copies_unordered"] = capture_checks.copies(acl_graph.capture(unordered, ring_args, npugraph_ex_config())["gm"])
    try:
        acl_graph.capture(write, ring_args, raw(input_inplace_pass=False))
    except Exception as e:  # noqa: BLE001 - what npugraph_ex raises is the result
        out["no_inplace_ring"] = [line for line in str(e).splitlines() if "pickleable" in line][:1]
    got = acl_graph.capture(_bump, (torch.zeros(8), torch.ones(8)), raw(input_inplace_pass=False))
    out["no_inplace_bump"] = {
        "targets": [str(n.target) for n in got["gm"].graph.nodes if n.op == "call_function"],
        "copies": capture_checks.copies(got["gm"]),
    }
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
