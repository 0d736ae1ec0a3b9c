from .wheel import TorchairUnavailable, op_table, torchair_sources

"""NPU graphs without an NPU: torchair's own FX-to-GE converters, run on this host.

- :mod:`.wheel`: torchair's Python sources from the torch-npu wheel, unpacked into a cache.
- :mod:`.host`: the set-up of a conversion process (no ``torch_npu``, a stand-in for the native module).
- :mod:`.ge_graph`: what a converted GE graph says: op census, Hcom schedule, streams, and whether
  its partial order keeps the prefetch bounds.
- :mod:`.invariant_graph`: whether a GE or ACL graph of the invariant mode holds only the invariant functions' ops.
- :mod:`.capture_ops`: whether a captured region holds only ops ACL graph capture takes (torch-npu's own op table).

The conversion itself runs in a subprocess (``python -m tools.ge_graphs``, from the repository), never
in a process that imports torch for anything else.
"""

__all__ = [
    "TorchairUnavailable",
    "torchair_sources",
    "op_table",
]
