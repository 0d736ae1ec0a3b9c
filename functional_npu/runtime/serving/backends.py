"""The one place that picks and configures the compiler.

``"auto"`` is torchair on a working Ascend NPU, inductor on CPU and CUDA ("reduce-overhead", i.e.
CUDA graphs, on CUDA); ``"eager"`` and ``"aot_eager"`` are for debugging; ``"none"`` runs the plain
Python forward with no ``torch.compile`` at all. NPU detection imports
``torch_npu`` inside a try that catches anything (torch-npu without CANN fails at import) and
never trusts ``"npu" in torch._dynamo.list_backends()``. A backend also carries the ordering hints
the forward states in the graph (:class:`functional_npu.parallel.streams.Streams`): torchair's
multi-stream scopes for torchair, npugraph_ex's stream scope and tagged events for ``"npugraph_ex"``
(ACL graph capture, what ``torch.compile(backend="npugraph_ex")`` runs), none elsewhere.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...models.invariant_ops import decompositions
from ...parallel.streams import COPY_BACK, INLINE, Streams

__all__ = [
    "Backend",
    "BACKENDS",
    "resolve_backend",
    "npu_status",
    "torchair_streams",
    "npugraph_ex_streams",
    "npugraph_ex_config",
    "check_npugraph_ex_config",
    "REFUSED_NPUGRAPH_EX_OPTIONS",
    "REQUIRED_NPUGRAPH_EX_OPTIONS",
    "EVENT_PREFIX",
    "modes",
    "INDUCTOR_MODES",
    "MODES",
    "FASTEST_MODES",
]

log = logging.getLogger("functional_npu")

BACKENDS = ("auto", "inductor", "torchair", "eager", "aot_eager", "none", "npugraph_ex")
EVENT_PREFIX = "functional_npu."  # the tagged events the npugraph_ex hints record and wait
TORCHAIR_MODES = ("max-autotune", "reduce-overhead")  # GE graph mode, captured (aclgraph) mode
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MODES = tuple(dict.fromkeys(TORCHAIR_MODES + INDUCTOR_MODES))  # every backend's modes, on any device
# the mode each device compiles with when none is given: the one that measures fastest for decode there
# (benchmarks/README.md, the scoreboard: on the CPU inductor's C++ wrapper, on CUDA its CUDA graphs)
FASTEST_MODES = {"cpu": "default", "cuda": "reduce-overhead"}


@dataclass(frozen=True)
class Backend:
    """A resolved compiler choice: what to pass to ``torch.compile``."""

    name: str  # "torchair" | "npugraph_ex" | "inductor" | "eager" | "aot_eager" | "none"
    device_type: str  # "npu" | "cuda" | "cpu"
    mode: str | None = None
    compiler: Any = field(default=None, repr=False)  # the torch.compile backend (callable or name)
    streams: Streams = field(default=INLINE, repr=False)  # ordering hints the forward puts in the graph

    @property
    def captures(self) -> bool:
        """Whether the compiled graphs are replayed as captured CUDA graphs (inductor's reduce-overhead and
        max-autotune on CUDA): their inputs must keep their addresses and their outputs are overwritten by the
        next replay."""
        return (
            self.name == "inductor" and self.device_type == "cuda" and self.mode in ("reduce-overhead", "max-autotune")
        )

    @property
    def kernels(self) -> str:
        """Whose quantized matmuls the weights are prepared for (:func:`functional_npu.models.linear.prepare`):
        ``"npu"`` (Ascend's, which torchair converts to their GE ops), ``"cpu"`` (torch's CPU kernels), or
        ``"dense"`` (dequantized: torch's CUDA int8 / int4 kernels take other packings)."""
        if self.name in ("torchair", "npugraph_ex") or self.device_type == "npu":
            return "npu"
        return "cpu" if self.device_type == "cpu" else "dense"

    def compile(
        self,
        fn: Callable[..., Any],
        *,
        inductor_options: dict[str, Any] | None = None,
        guard_filter: Callable[..., Any] | None = None,
        **options: Any,
    ) -> Callable[..., Any]:
        """``torch.compile(fn, fullgraph=True, backend=..., mode=...)`` with extra ``options``.

        ``inductor_options`` are inductor config entries for this compile only (ignored by other
        backends); the mode's own entries are merged in, since ``torch.compile`` takes one or the other.
        ``guard_filter``: dynamo's ``guard_filter_fn``, which guards to keep (a precompiled graph keeps those
        it can save).
        """
        if self.name == "none":
            return fn
        kwargs: dict[str, Any] = {"fullgraph": True, "backend": self.compiler}
        if self.name == "inductor" and self.device_type == "cpu" and self.mode == "reduce-overhead":
            # inductor's C++ wrapper in place of the Python one around the kernel calls. Not the CPU's default: a
            # decode step is one fused kernel now (linear.streamed), so it measures no faster, its cold compiles
            # take about a third longer, and in torch 2.13 it refuses graphs with collectives ("arg type Any is
            # not yet supported by custom_op_wrapper", tp = 2)
            kwargs["options"] = {"cpp_wrapper": True} | (inductor_options or {})
        elif self.name == "inductor" and (inductor_options or guard_filter):
            from torch._inductor import list_mode_options

            kwargs["options"] = (list_mode_options(self.mode) if self.mode else {}) | (inductor_options or {})
        elif self.name == "inductor" and self.mode:
            kwargs["mode"] = self.mode
        if guard_filter is not None:
            kwargs["options"] = kwargs.get("options", {}) | {"guard_filter_fn": guard_filter}
        return torch.compile(fn, **kwargs, **options)


def npu_status() -> tuple[bool, str]:
    """(usable, reason): whether torch_npu imports and sees a device. Never raises."""
    try:
        importlib.import_module("torch_npu")
    except BaseException as e:  # noqa: BLE001 - torch-npu without CANN raises anything from OSError to SystemExit
        return False, f"torch_npu is not importable ({type(e).__name__}: {e})"
    try:
        if torch.npu.is_available():  # type: ignore[attr-defined]
            return True, "torch_npu sees an NPU"
        return False, "torch_npu imported but torch.npu.is_available() is False"
    except BaseException as e:  # noqa: BLE001
        return False, f"torch.npu.is_available() failed ({type(e).__name__}: {e})"


def torchair_streams() -> Streams:
    """torchair's multi-stream scopes as :class:`~functional_npu.parallel.streams.Streams`: ``side`` is
    ``torchair.scope.npu_stream_switch`` (a ``_user_stream_label`` on the enclosed GE ops) and
    ``after`` is ``torchair.scope.npu_wait_tensor`` (an ``Identity`` with a control edge)."""
    from torchair import scope  # type: ignore[import-not-found]  # only importable with torchair

    return Streams("torchair", scope.npu_stream_switch, scope.npu_wait_tensor)


class _SideStream:
    """npugraph_ex's stream scope around the enclosed ops, entered after everything the current stream has issued.

    Entering records the tagged event ``<prefix><tag>.issue`` on the current stream, opens
    ``npugraph_ex.scope_enter(["_user_stream_label", ...], [tag, ...])`` (npugraph_ex captures the enclosed ops
    under ``torch.npu.stream`` of one stream per label) and waits for that event there; leaving closes the scope.
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __enter__(self) -> None:
        from npugraph_ex.scope._scope import _npu_scope_enter  # type: ignore[import-not-found]

        torch.ops.npugraph_ex.tagged_event_record(EVENT_PREFIX + self.tag + ".issue", True)
        _npu_scope_enter([("_user_stream_label", self.tag), ("_user_stream_priority", "0")])
        torch.ops.npugraph_ex.tagged_event_wait(EVENT_PREFIX + self.tag + ".issue", True)

    def __exit__(self, *_: Any) -> None:
        from npugraph_ex.scope._scope import _npu_scope_exit  # type: ignore[import-not-found]

        _npu_scope_exit()


def _event_record(name: str) -> None:
    torch.ops.npugraph_ex.tagged_event_record(EVENT_PREFIX + name, True)


def _event_wait(name: str) -> None:
    torch.ops.npugraph_ex.tagged_event_wait(EVENT_PREFIX + name, True)


def npugraph_ex_streams() -> Streams:
    """npugraph_ex's ordering as :class:`~functional_npu.parallel.streams.Streams`: ``side`` is its
    ``_user_stream_label`` scope (one stream per label, reused by every scope of that label) entered after an
    event recorded on the current stream; ``signal`` / ``wait`` record and wait a tagged event
    (``torch.ops.npugraph_ex.tagged_event_record`` / ``tagged_event_wait``, executed on the current stream while
    capturing). ``after`` adds nothing: in a captured graph only events order streams."""
    import npugraph_ex.ops._tagged_event  # type: ignore[import-not-found]  # noqa: F401 - defines the event ops
    import npugraph_ex.scope  # type: ignore[import-not-found]  # noqa: F401 - defines scope_enter / scope_exit

    return Streams("npugraph_ex", _SideStream, INLINE.after, signal=_event_record, wait=_event_wait)


def _create_events(gm: torch.fx.GraphModule, *_: Any) -> None:
    """A ``post_grad_custom_pre_pass``: create the tagged events this library's hints use (npugraph_ex creates
    the events of its own passes; ``created_inside`` events are looked up in its ``_GLOBAL_SCOPE_TAG_TO_EVENT``
    and re-created per graph from the names found here)."""
    from npugraph_ex._acl_concrete_graph.graph_pass import _create_event_by_name  # type: ignore[import-not-found]

    for node in gm.graph.nodes:
        if str(node.target).startswith("npugraph_ex.tagged_event_") and str(node.args[0]).startswith(EVENT_PREFIX):
            _create_event_by_name(node.args[0])


# npugraph_ex options (``CompilerConfig``) this library refuses, with the value refused and why. The ring's slots and
# the KV caches are graph inputs the graph writes in place (npugraph_ex's ``mutated_user_inputs``); a captured graph
# writes them at the addresses it was captured with, so npugraph_ex must keep checking those addresses
# (``AclGraph.is_need_to_recapture``, acl_graph.py) and must write the inputs where they lie. ``clone_input`` is not
# here: it copies only the inputs npugraph_ex does not see mutated (``AclGraph.capture`` skips
# ``mutated_user_inputs``; ``process_input`` copies only the inputs capture recorded), never a slot.
REFUSED_NPUGRAPH_EX_OPTIONS: dict[str, tuple[Any, str]] = {
    "unsafe_skip_npugraph_capture_validation": (
        True,
        "it skips npugraph_ex's recapture check, so a replay writes the ring slots and KV caches at the addresses of "
        "the capture, not where they now lie",
    ),
    "force_recapture": (
        True,
        "it recaptures on every call, which hides a ring slot or cache whose address moved between steps and "
        "captures the graph anew each step",
    ),
    "input_inplace_pass": (
        False,
        "without it npugraph_ex leaves the writes into graph inputs out of place: an in-place update becomes a new "
        "buffer copied back into the input, and a ring slot's broadcast stays functionalized (on a copy of the slot), "
        "which npugraph_ex then fails to compile",
    ),
}


# npugraph_ex options this library holds at one value, with why. ``capture_error_mode`` is the ACL capture mode
# (``torch_npu.npu.graph(capture_error_mode=...)``, as CUDA's stream capture modes): "global" makes a call that is
# unsafe during capture (a device allocation outside the graph's pool, a synchronous copy or memset) fail at capture,
# from any thread; "thread_local" only from the capturing thread (the host link's copy thread would slip through);
# "relaxed" lets it run, so the captured graph silently lacks it.
REQUIRED_NPUGRAPH_EX_OPTIONS: dict[str, tuple[Any, str]] = {
    "capture_error_mode": (
        "global",
        "only 'global' makes an allocation, synchronous copy or memset inside the captured region fail at capture "
        "(from any thread); 'thread_local' misses other threads' and 'relaxed' lets them run outside the graph, so "
        "its replays silently lack them",
    ),
}


def check_npugraph_ex_config(config: Any) -> Any:
    """``config`` (npugraph_ex's ``CompilerConfig``), after checking it sets none of
    :data:`REFUSED_NPUGRAPH_EX_OPTIONS` and holds each of :data:`REQUIRED_NPUGRAPH_EX_OPTIONS` at its value.

    Raises:
        ValueError: one line naming the option, the value, why, and the value to leave it at.
    """
    for name, (refused, why) in REFUSED_NPUGRAPH_EX_OPTIONS.items():
        option = getattr(config, name, None)
        value = getattr(option, "value", option)
        if option is not None and value == refused:
            raise ValueError(f"npugraph_ex option {name}={value!r} is refused: {why}; leave {name} at {not refused!r}")
    for name, (required, why) in REQUIRED_NPUGRAPH_EX_OPTIONS.items():
        option = getattr(config, name, None)
        value = getattr(option, "value", option)
        if value != required:
            raise ValueError(f"npugraph_ex option {name}={value!r} is refused: {why}; leave {name} at {required!r}")
    return config


def npugraph_ex_config(**options: Any) -> Any:
    """npugraph_ex's ``CompilerConfig`` as this library compiles with it: its defaults, ``options`` (its option
    names, e.g. ``capture_limit=8``, ``deadlock_check=True``), and the pre-pass that creates the tagged events of
    :func:`npugraph_ex_streams`.

    Raises:
        ValueError: an option of :data:`REFUSED_NPUGRAPH_EX_OPTIONS` at its refused value, one of
            :data:`REQUIRED_NPUGRAPH_EX_OPTIONS` at another than its own (one line naming it), or
            ``post_grad_custom_pre_pass`` (this library's own).
    """
    import npugraph_ex  # type: ignore[import-not-found]

    if "post_grad_custom_pre_pass" in options:
        raise ValueError(
            "npugraph_ex option post_grad_custom_pre_pass is this library's (it creates the tagged events of the "
            "stream hints); use post_grad_custom_post_pass"
        )
    config = npugraph_ex.CompilerConfig()
    for name, (required, _) in REQUIRED_NPUGRAPH_EX_OPTIONS.items():
        setattr(config, name, required)  # explicit: a later default does not loosen it
    for name, value in options.items():
        setattr(config, name, value)
    config.post_grad_custom_pre_pass = _create_events
    return check_npugraph_ex_config(config)


def _npugraph_ex(options: Mapping[str, Any]) -> Any:
    import npugraph_ex  # type: ignore[import-not-found]  # sys.modules' lazy alias, set by torch_npu

    config = npugraph_ex_config(**options)
    # the invariant ops as their aten ops: npugraph_ex captures aten ops, not an opaque one
    return npugraph_ex.get_npu_backend(compiler_config=config, custom_decompositions=decompositions())


def _torchair(mode: str | None) -> Any:
    import torchair  # only importable after torch_npu

    from . import ge_converters  # registers the GE converters of this library's ops

    # the prefetch ring's slots are inputs the graph writes in place: RefData, no copy (see ge_converters.configure)
    config = ge_converters.configure(torchair.CompilerConfig())
    config.mode = mode or "max-autotune"
    # the invariant ops as their aten ops (models.invariant's trees): torchair has no converter for an opaque op
    return torchair.get_npu_backend(compiler_config=config, custom_decompositions=decompositions())


def modes(name: str, device_type: str) -> tuple[str, ...]:
    """The modes backend ``name`` takes on ``device_type`` (none: it takes no mode).

    Raises:
        ValueError: an unknown backend name or device type.
    """
    _check_names(name, device_type)
    if name == "torchair":
        return TORCHAIR_MODES
    if name in ("inductor", "auto") and device_type != "npu":
        return INDUCTOR_MODES
    return ()


def _check_names(name: str, device_type: str | None) -> None:
    """Refuse a backend name not in ``BACKENDS`` and a device type torch does not know (nor ``"npu"``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if device_type is None or device_type == "npu":
        return
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str ('cpu', 'cuda', 'npu', ...), got {type(device_type).__name__}")
    try:
        known = ":" not in device_type and torch.device(device_type) is not None
    except RuntimeError:
        known = False
    if not known:
        raise ValueError(
            f"device_type {device_type!r} is not a device type ('cpu', 'cuda', 'npu', ...); give the params' "
            f"device type (params['embed'].device.type), or None: the detected accelerator"
        )


def _check_mode(name: str, device_type: str, mode: str | None) -> None:
    if mode is not None and mode not in modes(name, device_type):
        have = modes(name, device_type)
        raise ValueError(
            f"mode {mode!r}: backend {name!r} on {device_type!r} "
            + (f"has the modes {', '.join(have)}" if have else "takes no mode")
            + " (or none: the one measured fastest there)"
        )


def resolve_backend(
    name: str = "auto",
    *,
    mode: str | None = None,
    device_type: str | None = None,
    probe: Callable[[], tuple[bool, str]] = npu_status,
    options: Mapping[str, Any] | None = None,
) -> Backend:
    """Turn a backend name into a :class:`Backend`.

    Args:
        name: one of ``BACKENDS``.
        mode: torchair: "max-autotune" (GE graph, the default) or "reduce-overhead" (captured graph);
            inductor: one of ``INDUCTOR_MODES``, default the device's fastest (``FASTEST_MODES``); on CPU
            "reduce-overhead" means inductor's C++ wrapper, as CUDA graphs do not exist there, and "default" its
            Python wrapper. Other backends take no mode. :func:`modes` lists them.
        device_type: where the model runs (default: the detected accelerator, else "cpu").
        probe: whether an NPU is usable, and why not (default :func:`npu_status`; a test that stands in for the
            device passes its own, and everything else runs as on the device).
        options: npugraph_ex's ``CompilerConfig`` options for backend ``"npugraph_ex"`` (its names, e.g.
            ``{"capture_limit": 8}``; :func:`npugraph_ex_config` refuses those that would hide a moved input).

    Raises:
        ValueError for an unknown name, a mode the backend does not have on the device (naming its modes), or
        ``"torchair"`` without a working NPU, ``options`` for another backend than ``"npugraph_ex"``.
    """
    _check_names(name, device_type)
    if options and name != "npugraph_ex":
        raise ValueError(
            f"options {sorted(options)} are npugraph_ex's CompilerConfig options, and backend {name!r} takes none; "
            f"use backend 'npugraph_ex' or leave options out"
        )
    if name == "torchair" and device_type not in (None, "npu"):
        raise ValueError(
            f"backend 'torchair' compiles for an Ascend NPU, but the params are "
            f"on {device_type!r}; move them to 'npu' or use backend='inductor'"
        )
    if name == "npugraph_ex":
        if device_type not in (None, "npu"):
            raise ValueError(
                f"backend 'npugraph_ex' captures ACL graphs on an Ascend NPU, but the params are on {device_type!r}; "
                f"move them to 'npu' or use backend='inductor'"
            )
        ok, why = probe()
        if not ok:
            raise ValueError(f"backend 'npugraph_ex' needs a working Ascend NPU: {why}")
        if mode is not None:
            raise ValueError(f"backend 'npugraph_ex' takes no mode (got {mode!r}): it always captures an ACL graph")
        return Backend("npugraph_ex", "npu", None, _npugraph_ex(options or {}), npugraph_ex_streams())
    if name in ("auto", "torchair") and device_type in (None, "npu"):
        ok, why = probe()
        if ok:
            _check_mode("torchair", "npu", mode)
            mode = mode or "max-autotune"
            # the scopes are GE graph-mode ops; captured (aclgraph) mode orders by capture, with no hints
            streams = torchair_streams() if mode == "max-autotune" else INLINE
            return Backend("torchair", "npu", mode, _torchair(mode), streams)
        if name == "torchair":
            raise ValueError(f"backend 'torchair' needs a working Ascend NPU: {why}")
        if device_type == "npu":
            raise ValueError(f"device_type 'npu' requested but {why}")
        if why and "No module named 'torch_npu'" not in why:
            log.warning("functional_npu: no usable NPU (%s); using inductor", why)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    _check_mode("inductor" if name == "auto" else name, device_type, mode)
    if name in ("eager", "aot_eager", "none"):  # aot_eager functionalizes and copies mutated inputs back
        return Backend(
            name, device_type, None, None if name == "none" else name, COPY_BACK if name == "aot_eager" else INLINE
        )
    return Backend("inductor", device_type, mode or FASTEST_MODES.get(device_type), "inductor")
