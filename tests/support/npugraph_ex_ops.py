"""The schemas of npugraph_ex's scope and event ops (its ``ops/`` and ``scope/``), defined without kernels, so that a
test process that never installs npugraph_ex can build and parse graphs that name them."""

import torch

if not hasattr(torch.ops.npugraph_ex, "scope_enter"):
    LIB = torch.library.Library("npugraph_ex", "FRAGMENT")
    LIB.define("scope_enter(str[] keys, str[] values, bool need_execute=False) -> None")
    LIB.define("scope_exit(bool need_execute=False) -> None")
    LIB.define("tagged_event_record(str tag, bool created_inside=False) -> ()")
    LIB.define("tagged_event_wait(str tag, bool created_inside=False) -> ()")
