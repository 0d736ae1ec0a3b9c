"""The parallel techniques as data over a mesh: the :class:`Plan`, module TP, layer sharding and its
prefetch ring (the ring's schedule, the streams hints, the cost model and device profiles; its hazard check is
:mod:`functional_npu.checks`), expert parallelism's EP <-> TP exchange and EPLB's placement maps and rebalancing.

Each module is one technique (docs/architecture.md); this face re-exports their public names.
"""

from .devices import DEVICES, Device, Link, device
from .ep_tp import ep_to_tp, expert_layouts, tp_to_ep
from .eplb_balance import balanced_placement
from .eplb_map import default_placement, plan_rebalance, rank_program, rebalance, routing_table, validate_placement
from .host_link import EmulatedHostLink
from .layer_shard import LayerShard, layer_shard, owned_layers, resident_bytes, series_specs, stack_series
from .module_tp import ModuleTP, dp_axes, split_dp
from .offload import host_specs, stack_host, unstack_host
from .plan import Plan
from .prefetch import drain, new_ring, ready, start
from .prefetch_cost import (
    choose_k,
    exposed,
    host_layer_bytes,
    host_step,
    layer_bytes,
    roofline_layer_s,
    simulate,
    step_time,
)
from .prefetch_ring import Ring, RingGroup, RingPhase, coalesced, phases, ring_of
from .streams import COPY_BACK, INLINE, Streams

__all__ = [
    "EmulatedHostLink",
    "Link",
    "Device",
    "DEVICES",
    "device",
    "expert_layouts",
    "ep_to_tp",
    "tp_to_ep",
    "balanced_placement",
    "validate_placement",
    "default_placement",
    "routing_table",
    "plan_rebalance",
    "rank_program",
    "rebalance",
    "LayerShard",
    "layer_shard",
    "series_specs",
    "stack_series",
    "host_specs",
    "stack_host",
    "unstack_host",
    "owned_layers",
    "resident_bytes",
    "ModuleTP",
    "split_dp",
    "dp_axes",
    "Plan",
    "coalesced",
    "RingPhase",
    "phases",
    "Ring",
    "RingGroup",
    "ring_of",
    "new_ring",
    "start",
    "drain",
    "ready",
    "step_time",
    "simulate",
    "exposed",
    "choose_k",
    "roofline_layer_s",
    "layer_bytes",
    "host_layer_bytes",
    "host_step",
    "Streams",
    "INLINE",
    "COPY_BACK",
]
