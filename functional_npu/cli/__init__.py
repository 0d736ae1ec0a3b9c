from .demo import DEMO_HF_CONFIG, SMALL_HF_CONFIG
from .main import build_parser, main

__all__ = ["main", "build_parser", "DEMO_HF_CONFIG", "SMALL_HF_CONFIG"]
