"""Updates of a captured graph's inputs between replays: none may land while the previous replay can still read it.

A captured graph (an ACL graph on the NPU, a CUDA graph) reads its inputs at the addresses it was captured with,
and a replay returns to the host before the device has run it. Serving updates per-step inputs in place between
replays (block tables, positions, sequence lengths): the update for step ``i`` must not be seen by step ``i - 1``'s
replay. vllm-ascend synchronizes the stream before each full-graph replay for this reason; without an order, its
users saw wrong tokens or hangs.

The host's actions over a run are a :class:`Action` list in issue order:

- ``replay``: a graph replayed on ``stream``, reading ``inputs``;
- ``write``: ``inputs`` written on ``stream`` (a copy into the input, ordered on that stream), or by the host itself
  (``stream="host"``: a write into memory the device reads directly, pinned or mapped, ordered with nothing);
- ``sync``: the host waits until ``stream`` has run everything issued on it (a synchronize, or the host reading a
  result of that stream, as a sampled token);
- ``record`` / ``wait``: an event recorded on ``stream`` after what was issued there, and a wait for it on
  ``stream`` before what comes next there.

:func:`check` returns one line per write that a replay issued before it may still be reading: the write and the
replay are on different streams (or the write is the host's) and no chain of stream order, events and host
synchronizations puts the replay's end before the write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Action", "check", "HOST", "KINDS"]

HOST = "host"
KINDS = ("replay", "write", "sync", "record", "wait")


@dataclass(frozen=True)
class Action:
    """One host action (see the module docstring). ``name``: the graph of a replay, the event of a record or wait."""

    kind: str
    stream: str
    inputs: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"replay_updates: an action's kind is one of {KINDS}, got {self.kind!r}")
        if self.kind in ("record", "wait") and not self.name:
            raise ValueError(f"replay_updates: a {self.kind} names its event")


def _done_before(actions: Sequence[Action], i: int, j: int) -> bool:
    """Whether everything issued on ``actions[i].stream`` up to ``i`` has run before ``actions[j]`` runs: the same
    stream (stream order), a host ``sync`` of that stream between them (then anything issued after it, on any stream,
    comes later), or an event recorded on it after ``i`` and waited on ``j``'s stream before ``j``, whose record is
    itself done before the wait (chains through further streams)."""
    source, target = actions[i].stream, actions[j].stream
    if source == target and source != HOST:
        return True
    for m in range(i + 1, j):
        a = actions[m]
        if a.kind == "sync" and a.stream == source:
            return True
        if a.kind == "record" and a.stream == source:
            for n in range(m + 1, j):
                w = actions[n]
                if w.kind == "wait" and w.name == a.name and (w.stream == target or _done_before(actions, n, j)):
                    return True
    return False


def check(actions: Sequence[Action]) -> list[str]:
    """Every write into an input that an earlier replay reads, unordered with that replay's end (module docstring)."""
    problems = []
    for j, w in enumerate(actions):
        if w.kind != "write":
            continue
        for i in range(j - 1, -1, -1):
            r = actions[i]
            if r.kind != "replay":
                continue
            shared = sorted(set(r.inputs) & set(w.inputs))
            if shared and not _done_before(actions, i, j):
                where = "by the host" if w.stream == HOST else f"on stream {w.stream!r}"
                problems.append(
                    f"update: {', '.join(shared)} written {where} (action {j}) while replay {r.name or i} on stream "
                    f"{r.stream!r} (action {i}) may still read it: no synchronization or event orders them; "
                    f"synchronize {r.stream!r} before the write, or record an event after the replay and wait on it "
                    f"where the write is issued"
                )
    return problems
