"""What runs a model, by concept, each folder with a face that re-exports its names:

- :mod:`.loading`: checkpoints in (a rank's slices only) and out;
- :mod:`.serving`: the compiled model, its backends, caches and the generation path;
- :mod:`.training`: gradients, AdamW, the compiled train step, GRPO, the weight sync to the inference plan;
- :mod:`.planning`: choosing the plan on a device profile;
- :mod:`.launch`: local multi-rank worlds (the CLI's and the tests' process harness).
"""

from . import loading, planning, serving, training
from .launch import LocalWorld, RankContext, RemoteError, watch_parent

__all__ = ["loading", "serving", "training", "planning", "LocalWorld", "RankContext", "RemoteError", "watch_parent"]
