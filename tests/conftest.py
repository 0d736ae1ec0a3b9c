import os

import pytest
from hypothesis import HealthCheck, settings

# Deterministic, deadline-free runs: CI machines are small and first calls compile.
settings.register_profile(
    "default",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=1000, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# One world of each size for the whole session (of each pytest-xdist worker): starting one (spawning its ranks,
# importing torch, joining the process group) costs seconds on 2 cores, once per module otherwise. A rank's failure
# stops the world and the next run starts it again (LocalWorld.run), so a failing test leaves the next a fresh one.
# (Worlds were per module for a while: a long-lived rank once aborted on heap corruption, "malloc(): unaligned tcache
# chunk detected". Its cause was torch's gloo path for two functional all_gathers in flight on one group, which gather
# no longer issues: its docstring in functional_npu/core/shard.py.)
@pytest.fixture(scope="session")
def world2():
    from functional_npu.runtime.launch import LocalWorld

    with LocalWorld(2, timeout=300) as world:
        yield world


@pytest.fixture(scope="session")
def world4():
    from functional_npu.runtime.launch import LocalWorld

    with LocalWorld(4, timeout=300) as world:
        yield world
