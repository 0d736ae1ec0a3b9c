"""Tools that produce or check the repository's artifacts, outside the library: ``python -m tools.graphs`` (the
golden captured graphs in graphs/); ``python tools/extract_torchair_ops.py`` (the ops torchair converts)."""
