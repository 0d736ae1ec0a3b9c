"""Updates of a captured graph's inputs between replays (functional_npu/checks/replay_updates.py): the planted
orders that fail (an update stream with no event, as a full-graph replay with per-step parameters updated on a
stream of their own; a host write into a mapped input with no synchronization) and the orders that pass (the same
stream, an event, a synchronization); and the serving engine's own steps, recorded at the aten ops it issues: every
update of a step's inputs is a copy on the stream that replays the step, and the host reads each step's logits
before it writes the next step's inputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from functional_npu import Mesh, compile_model, load_checkpoint
from functional_npu.checks.replay_updates import HOST, Action, check
from functional_npu.runtime.serving import Engine, Request

from ..support.hf_models import save_tiny

R = Action("replay", "main", ("block_table", "positions"), "decode")
W = Action("write", "update", ("block_table",))


def test_an_update_stream_without_an_event_may_write_under_the_previous_replay():
    problems = check([R, W, R])
    assert problems == [
        "update: block_table written on stream 'update' (action 1) while replay decode on stream 'main' (action 0) "
        "may still read it: no synchronization or event orders them; synchronize 'main' before the write, or record "
        "an event after the replay and wait on it where the write is issued"
    ]


@pytest.mark.parametrize(
    "order",
    [
        [R, Action("record", "main", name="e"), Action("wait", "update", name="e"), W, R],  # an event
        [R, Action("sync", "main"), W, R],  # the host synchronizes first (vllm-ascend's fix)
        [R, Action("write", "main", ("block_table",)), R],  # the same stream
        [R, Action("write", "update", ("seq_lens",)), R],  # an input the replay does not read
        [  # a chain: main -> side -> update
            R,
            Action("record", "main", name="a"),
            Action("wait", "side", name="a"),
            Action("record", "side", name="b"),
            Action("wait", "update", name="b"),
            W,
        ],
    ],
    ids=["event", "sync", "same stream", "other input", "event chain"],
)
def test_an_ordered_update_passes(order):
    assert check(order) == []


def test_a_host_write_needs_a_synchronization_and_an_event_recorded_too_early_orders_nothing():
    host = Action("write", HOST, ("positions",))
    assert check([R, host]) and check([R, Action("sync", "main"), host]) == []
    early = [Action("record", "main", name="e"), R, Action("wait", "update", name="e"), W]
    assert len(check(early)) == 1  # the event was recorded before the replay was issued


def test_an_action_of_no_known_kind_is_refused():
    with pytest.raises(ValueError, match=r"an action's kind is one of .*got 'launch'"):
        Action("launch", "main")


class _Record(TorchDispatchMode):
    """Every aten op the engine issues: its name, the storages it reads and the ones it writes (from the schema).
    It holds every storage it saw until it is dropped, so no address is freed and reused while it records: an
    address names one storage (a block table made mid-run, for a new batch bucket, may otherwise land where a
    temporary read earlier lived, and that temporary's reads would count as the table's)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[int], set[int]]] = []
        self.held: list[torch.UntypedStorage] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads, writes = set(), set()
        for arg, value in zip(
            func._schema.arguments, list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args) :]]
        ):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                self.held.append(storage)
                ptr = storage.data_ptr()
                (writes if arg.alias_info is not None and arg.alias_info.is_write else reads).add(ptr)
        self.ops.append((str(func.overloadpacket), reads, writes))
        return func(*args, **kwargs)


def test_the_engine_updates_a_step_inputs_on_the_replay_stream_after_reading_the_last_step(tmp_path):
    """Three requests over a few steps of the engine on the CPU (one stream): each write into a block table is an
    aten ``copy_`` (a device copy on the stream that replays the step, never a host write into the input), and
    between a step that reads a table and the next write into it the host reads a result (``_local_scalar_dense``:
    a synchronization). The actions built from that record pass the check; moved to an update stream, they would
    still pass for the synchronization, and fail without it."""
    save_tiny("qwen3", tmp_path, 7, num_hidden_layers=1)
    one = Mesh.abstract({"tp": 1}, 0)
    model = compile_model(load_checkpoint(str(tmp_path), one), one, backend="none", batch_sizes=[1, 2, 4],
                          max_seq_len=32, prefill_lengths=[8, 32])  # fmt: skip
    engine = Engine(model, blocks=40, block_size=4, chunk=8)
    for i, prompt in enumerate(([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13])):
        engine.add(Request(tuple(prompt), max_new_tokens=3), i)
    record = _Record()
    with record:
        while engine.has_work():
            engine.step()
    tables = {layer.table.untyped_storage().data_ptr() for state in engine._states.values() for layer in state.kv}
    actions: list[Action] = []
    for name, reads, writes in record.ops:
        if writes & tables:
            assert name == "aten.copy_", name  # a device copy, stream-ordered
            actions.append(Action("write", "main", tuple(sorted(map(str, writes & tables)))))
        elif reads & tables:
            actions.append(Action("replay", "main", tuple(sorted(map(str, reads & tables)))))
        elif name == "aten._local_scalar_dense":
            actions.append(Action("sync", "main"))
    kinds = [a.kind for a in actions]
    assert kinds.count("write") >= 4 and kinds.count("replay") > kinds.count("write")
    assert check(actions) == []
    elsewhere = [Action("write", "update", a.inputs) if a.kind == "write" else a for a in actions]
    assert check(elsewhere) == []  # the host's read of each step's logits orders it
    unsynced = [a for a in elsewhere if a.kind != "sync"]
    assert check(unsynced)  # the counterexample: without it the update stream races the replay
