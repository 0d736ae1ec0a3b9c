"""Choosing the plan: every candidate plan's modelled step or served throughput and its bytes per rank on a device
profile, the best that fits; this machine's own profile, measured once and cached.

- :mod:`.step_model`: ``Workload``, ``Candidate``, ``Estimate``, ``estimate`` (one step of one candidate),
  ``step_collectives`` / ``step_transfers`` (what it prices, call by call);
- :mod:`.serve`: ``Served``, ``serve_estimate`` (the batch a budget admits and the tokens/s it serves);
- :mod:`.disaggregated`: ``Disaggregated``, ``disaggregated_estimate`` (prefill and decode on separate device groups,
  the prompt's KV moved between them: priced, not run by this library);
- :mod:`.choose`: ``choose_plan``, ``candidates``, ``Report``, ``PlanDoesNotFit``, ``simplest`` and ``techniques``
  (a technique kept only where needed to fit or gaining more than the profile's spread);
- :mod:`.host_profile`: ``host_device``, this host measured.
"""

from .choose import (
    MAX_DEVICES,
    MAX_MEMORY,
    PlanDoesNotFit,
    Report,
    candidates,
    choose_plan,
    gb_at_least,
    simplest,
    techniques,
)
from .disaggregated import Disaggregated, disaggregated_estimate
from .host_profile import host_device
from .serve import Served, serve_estimate
from .step_model import Candidate, Estimate, Workload, estimate, step_collectives, step_transfers

__all__ = [
    "choose_plan",
    "MAX_DEVICES",
    "MAX_MEMORY",
    "Workload",
    "Candidate",
    "Estimate",
    "Served",
    "Disaggregated",
    "disaggregated_estimate",
    "Report",
    "PlanDoesNotFit",
    "candidates",
    "estimate",
    "serve_estimate",
    "gb_at_least",
    "host_device",
    "simplest",
    "techniques",
    "step_collectives",
    "step_transfers",
]
