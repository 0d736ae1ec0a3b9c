from .args import positive, positive_number
from .main import build_parser, main

__all__ = ["main", "build_parser", "positive", "positive_number"]
