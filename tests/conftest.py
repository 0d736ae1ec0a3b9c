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


# One world of each size per test module, started once and reused by its tests. (A world shared by the whole session
# saved about 90 s here, but once a rank of it, many modules old, aborted on heap corruption inside torch:
# "malloc(): unaligned tcache chunk detected". A module's own world keeps every rank's life short.)
@pytest.fixture(scope="module")
def world2():
    from functional_npu.runtime.launch import LocalWorld

    with LocalWorld(2, timeout=300) as world:
        yield world


@pytest.fixture(scope="module")
def world4():
    from functional_npu.runtime.launch import LocalWorld

    with LocalWorld(4, timeout=300) as world:
        yield world
