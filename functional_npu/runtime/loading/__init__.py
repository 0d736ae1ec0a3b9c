"""Checkpoints in and out: a rank's slices read from a Hugging Face directory or a DCP one, a training state of
DTensors moved to the inference plan, params written as a Hugging Face directory.

- :mod:`.checkpoint`: ``load_checkpoint`` (only this rank's slices), ``read_config``, ``read_quant``;
- :mod:`.hf_layout`: each leaf's Hugging Face tensors and how they are cut;
- :mod:`.dcp`: torch.distributed.checkpoint directories read a box at a time;
- :mod:`.dtensor_state`: ``from_dtensor_state`` (FSDP2 / FSDP2 + TP / HSDP states to the inference plan);
- :mod:`.save`: ``save_checkpoint``.
"""

from .checkpoint import load_checkpoint, read_config, read_quant
from .dtensor_state import from_dtensor_state
from .save import save_checkpoint

__all__ = [
    "load_checkpoint",
    "read_config",
    "read_quant",
    "save_checkpoint",
    "from_dtensor_state",
]
