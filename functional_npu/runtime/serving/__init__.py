r"""A model compiled and run: the backend chosen, prefill and decode traced whole on static buckets, the one
generation path, saved graphs for a warm start.

- :mod:`.backends`: which compiler (torchair, npugraph_ex, inductor, eager) and its mode;
- :mod:`.compile`: ``compile_model`` and its ``CompileOptions``, one path from loaded params to compiled graphs;
- :mod:`.compiled_model`: ``CompiledModel``, what runs the graphs (decode states, prefill, decode, generation);
- :mod:`.compile_policy`: what is decided before tracing (shape buckets, linear kernels, prefetch step, invariant
  options);
- :mod:`.generate`: chunks, padded prefill, decode, sampling, ``Lockstep``;
- :mod:`.engine`: ``Engine``, a stream of ``Request``\ s served by continuous batching over a paged KV cache, its
  blocks kept by :mod:`.kv_blocks`;
- :mod:`.compile_cache`, :mod:`.inductor_cache`: graphs saved for a later process; inductor's cache swept;
- :mod:`.ge_converters`: torchair converters for this library's ops (imported only where torchair is).
"""

from .backends import (
    Backend,
    modes,
    npu_status,
    npugraph_ex_config,
    npugraph_ex_streams,
    resolve_backend,
    torchair_streams,
)
from .compile import CompileOptions, compile_model, greedy_generate
from .compile_policy import batch_coverage, cache_length, check_comm_streams
from .compiled_model import CompiledModel, GraphBreakError
from .engine import Engine, Event, Request, stop_ids
from .generate import Lockstep, Samples, generate, sample

__all__ = [
    "compile_model",
    "CompileOptions",
    "CompiledModel",
    "greedy_generate",
    "cache_length",
    "batch_coverage",
    "check_comm_streams",
    "GraphBreakError",
    "generate",
    "sample",
    "Lockstep",
    "Samples",
    "Engine",
    "Request",
    "Event",
    "stop_ids",
    "Backend",
    "resolve_backend",
    "modes",
    "npu_status",
    "npugraph_ex_config",
    "npugraph_ex_streams",
    "torchair_streams",
]
