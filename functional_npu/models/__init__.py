"""Model families as pure forward functions over param pytrees."""

from . import llama
from .llama import ARCHITECTURES, LlamaConfig

__all__ = ["llama", "LlamaConfig", "ARCHITECTURES"]
