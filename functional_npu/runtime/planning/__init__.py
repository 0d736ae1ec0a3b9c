"""Choosing the plan: every candidate plan's modelled step and bytes per rank on a device profile, the fastest
that fits; this machine's own profile, measured once and cached.

- :mod:`.choose`: ``choose_plan``, ``Workload``, ``candidates``, ``estimate``;
- :mod:`.host_profile`: ``host_device``, this host measured.
"""

from .choose import (
    MAX_DEVICES,
    Candidate,
    Estimate,
    PlanDoesNotFit,
    Report,
    Workload,
    candidates,
    choose_plan,
    estimate,
)
from .host_profile import host_device, measure, profile_path

__all__ = [
    "choose_plan",
    "MAX_DEVICES",
    "Workload",
    "Candidate",
    "Estimate",
    "Report",
    "PlanDoesNotFit",
    "candidates",
    "estimate",
    "host_device",
    "measure",
    "profile_path",
]
