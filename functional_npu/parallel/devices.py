"""Device profiles: a device's roofline, memory and links, each figure with its source or marked assumed.

A :class:`Device` is what the cost models read: :mod:`.prefetch_cost` (how far ahead to fetch layer-sharded
weights) and the planner (:mod:`functional_npu.runtime.planning`, which plan is best and fits). The named
profiles in :data:`DEVICES` are published figures; ``host`` is this project's CI-class machine, measured
(:mod:`functional_npu.runtime.planning.host_profile` measures the machine it runs on, which then replaces it).

A collective over ``n`` ranks costs ``alpha + factor * payload / bandwidth`` (:meth:`Device.collective_s`):
``payload`` is the tensor the call is given (an all-gather's or reduce-scatter's full result), the
factor is the bytes each rank must move for it in a bandwidth-optimal algorithm (all-reduce
``2 (n - 1) / n``, all-gather / reduce-scatter / all-to-all ``(n - 1) / n``, broadcast 1), and the
bandwidth is what one rank can send at once: ``links`` point-to-point links of a full mesh (Ascend's
HCCS), one switch port (NVLink, Ascend's UB), or the inter-node network once the group's ranks sit on more
than one node (rank ``r`` on node ``r // node_size``: :meth:`Device.nodes_spanned`).
A profile measured per collective (``measured``) uses its own alpha and per-byte time instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Link", "Device", "DEVICES", "ALIASES", "COLLECTIVES", "UNFITTED_SPREAD", "device", "collective_factor"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
UNFITTED_SPREAD = 0.5  # a profile's assumed spread where no fit gives one: the roofline alone was 1.7x off (median)
GiB = 2**30


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: a transfer of ``b`` bytes takes ``alpha_s + b / bytes_per_s``."""

    bytes_per_s: float
    alpha_s: float = 0.0

    def __post_init__(self) -> None:
        if not _number(self.bytes_per_s) or not 0 < self.bytes_per_s < math.inf:
            raise ValueError(f"Link: bytes_per_s must be a positive finite number, got {self.bytes_per_s!r}")
        if not _number(self.alpha_s) or not 0 <= self.alpha_s < math.inf:
            raise ValueError(f"Link: alpha_s (seconds per transfer) must be finite and >= 0, got {self.alpha_s!r}")

    def time(self, nbytes: float) -> float:
        if not _number(nbytes) or not 0 <= nbytes < math.inf:
            raise ValueError(f"Link.time: nbytes must be a finite number of bytes >= 0, got {nbytes!r}")
        return self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Device:
    """A device's roofline, memory and links, with where the figures come from.

    Attributes:
        name: the profile's name.
        memory_bytes_per_s: the rate its memory streams weights at.
        flop_per_s: dense FLOP/s at the weights' dtype.
        link: one point-to-point link (a layer-sharded weight's broadcast from its owner runs on one).
        source: where the figures come from.
        memory_bytes: memory per device (``None``: not stated).
        links: point-to-point links a rank drives at once in a collective (a full mesh of 8: 7; a switch: 1).
        node_size: devices on the fast links (``None``: all); a group larger than this runs on ``inter_node``.
        inter_node: the per-device link between nodes.
        measured: ``"collective/n"`` -> ``(alpha_s, seconds per payload byte)`` over groups of ``n`` ranks,
            measured in a world of ``measured_world`` ranks (replaces the alpha-beta formula for those groups; see
            :mod:`functional_npu.runtime.planning.host_profile`).
        measured_world: the world size ``measured`` was taken at.
        assumed: the figures no source gives (named in reports).
        overlap: whether a collective runs beside compute (its own DMA engines and streams); on a CPU host whose
            cores the ranks' compute already fills, gloo's transfers take turns with it instead.
        host_link: the link from host memory to one device (pinned copies; series kept in host memory,
            ``Plan.offload``, fill the prefetch ring over it); ``None`` where the device's memory is the host's.
        step_overhead_s: the fixed cost of one step beyond its reads, compute and communication (the host's
            scheduling, launches, operator dispatch), added to every modelled step: measured by this library's own
            runs (``host``) or fitted to published serving figures (``python -m benchmarks planner_published``);
            ``None``: not known, the profile's figures are the roofline only (the planner warns).
        spread: the relative spread of the profile's modelled figures against measured ones (the fit's residuals);
            ``None``: not fitted (the planner then assumes :data:`UNFITTED_SPREAD`).
        formats: the weight and KV formats the device computes in (``"fp8"`` only where it has FP8 units: Hopper,
            not the 910B or 910C).
    """

    name: str
    memory_bytes_per_s: float
    flop_per_s: float
    link: Link
    source: str = ""
    memory_bytes: float | None = None
    links: int = 1
    node_size: int | None = None
    inter_node: Link | None = None
    measured: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    measured_world: int = 0
    assumed: tuple[str, ...] = ()
    overlap: bool = True
    host_link: Link | None = None
    step_overhead_s: float | None = None
    spread: float | None = None
    formats: tuple[str, ...] = ("bf16", "fp16", "int8", "int4")

    def __post_init__(self) -> None:
        """One line naming the first figure no plan can be priced with (a device's every figure is checked where the
        profile is made: a NaN, a zero bandwidth or a zero node size once reached the planner's arithmetic)."""
        fix = "give the figure (see functional_npu.parallel.devices.DEVICES for sourced ones)"
        for name in ("memory_bytes_per_s", "flop_per_s"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value < math.inf:
                raise ValueError(
                    f"the device profile {self.name!r} needs a positive finite {name} to price a plan, got {value!r}; "
                    f"{fix}"
                )
        for name in ("link", "inter_node", "host_link"):
            value = getattr(self, name)
            if not (isinstance(value, Link) or (value is None and name != "link")):
                raise ValueError(f"the device profile {self.name!r}: {name} must be a Link, got {value!r}; {fix}")
        checks = {
            "memory_bytes": (self.memory_bytes, lambda v: v is None or (_number(v) and 0 < v < math.inf)),
            "links": (self.links, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            "node_size": (self.node_size, lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 1)),
            "step_overhead_s": (self.step_overhead_s, lambda v: v is None or (_number(v) and 0 <= v < math.inf)),
            "spread": (self.spread, lambda v: v is None or (_number(v) and 0 <= v < math.inf)),
        }  # fmt: skip
        for name, (value, ok) in checks.items():
            if not ok(value):
                raise ValueError(
                    f"the device profile {self.name!r}: {name}={value!r} is not a figure it can take; {fix}"
                )

    @property
    def prediction_spread(self) -> float:
        """:attr:`spread`, or :data:`UNFITTED_SPREAD` where the profile has no fit."""
        return UNFITTED_SPREAD if self.spread is None else self.spread

    def collective_s(self, name: str, n: int, payload_bytes: float, *, nodes: int | None = None) -> float:
        """Seconds one collective ``name`` over ``n`` ranks takes for a payload of ``payload_bytes``
        (0 on one rank). ``nodes``: how many nodes the group's ranks sit on (:meth:`nodes_spanned`; ``None``: as
        few as ``n`` ranks can, i.e. consecutive ranks). A group on more than one node runs at the inter-node
        link's rate, one port per device."""
        if name not in COLLECTIVES:
            raise ValueError(f"collective {name!r} is not modelled; choose from {', '.join(COLLECTIVES)}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"collective_s: n (the group's ranks) must be an int >= 1, got {n!r}")
        if not _number(payload_bytes) or not 0 <= payload_bytes < math.inf:
            raise ValueError(
                f"collective_s: payload_bytes must be a finite number of bytes >= 0, got {payload_bytes!r}"
            )
        if n == 1:
            return 0.0
        if f"{name}/{n}" in self.measured:
            alpha, per_byte = self.measured[f"{name}/{n}"]
            return alpha + payload_bytes * per_byte
        link = self.link_for(nodes if nodes is not None else self.nodes_spanned(range(n)))
        across = link is not self.link
        width = 1 if across or name == "broadcast" else min(self.links, n - 1)
        return link.alpha_s + collective_factor(name, n) * payload_bytes / (link.bytes_per_s * width)

    def nodes_spanned(self, ranks: Iterable[int]) -> int:
        """How many nodes the global ``ranks`` sit on: rank ``r`` on node ``r // node_size`` (ranks filled node
        by node, as launchers place them); 1 when the profile has no nodes."""
        if self.node_size is None:
            return 1
        return len({r // self.node_size for r in ranks})

    def link_for(self, nodes: int) -> Link:
        """The link a group on ``nodes`` nodes runs at: the inter-node one once it spans nodes."""
        return self.inter_node if nodes > 1 and self.inter_node is not None else self.link


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def collective_factor(name: str, n: int) -> float:
    """Bytes each rank moves per payload byte in a bandwidth-optimal ``name`` over ``n`` ranks."""
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name == "broadcast":
        return 1.0
    return (n - 1) / n


# Named profiles. Figures a source does not give are listed in ``assumed``.
DEVICES: dict[str, Device] = {
    "ascend-910b": Device(
        "ascend-910b",
        memory_bytes_per_s=1.6e12,  # HBM 64 GB, 1600 GB/s
        flop_per_s=313e12,  # FP16 dense, 910B3 (376 on 910B2)
        # HCCS full mesh of 8: 7 links, 392 GB/s per NPU, so 56 GB/s from the owner to each peer; the
        # direction is not stated. alpha is assumed (no published small-message HCCL latency found)
        link=Link(bytes_per_s=56e9, alpha_s=20e-6),
        source=(
            "Huawei Atlas 800T A2 white paper (e.huawei.com/cn/documents/products/computing/"
            "b0b253c4d5da4e05ba80a39e3dc65fd2): 313 TFLOPS FP16 (910B3), HBM 64 GB at 1600 GB/s, 7 HCCS links, "
            "392 GB/s, 8 x 200GE RoCE between nodes; alpha 20 us assumed"
        ),
        memory_bytes=64 * GiB,  # npu-smi: 65536 MB of HBM
        links=7,
        node_size=8,
        inter_node=Link(bytes_per_s=25e9, alpha_s=50e-6),  # one 200GE port per NPU
        # PCIe 4.0 x16 to the host, about 25 GB/s one way in practice (no published H2D figure found: assumed)
        host_link=Link(bytes_per_s=25e9, alpha_s=20e-6),
        assumed=("link.alpha_s", "inter_node.alpha_s", "host_link"),
        # fitted to two vllm-ascend deployments (Qwen3-32B on 4 x 910B: TPOT at concurrency 1, a batch of 72 end to
        # end; benchmarks/results/planner_published.json); spread: the larger of the fit's leave-one-out error (19%)
        # and the held-out rows' median (21%)
        step_overhead_s=37.8e-3,
        spread=0.21,
    ),
    "ascend-910c": Device(  # one die: vllm-ascend and CANN present each of a 910C's two dies as a device
        "ascend-910c",
        memory_bytes_per_s=1.6e12,  # 3.2 TB/s per package (8 HBM2E stacks), half per die
        flop_per_s=390e12,  # 780 TFLOPS BF16 per package, half per die
        link=Link(bytes_per_s=196e9, alpha_s=20e-6),  # UB, fully non-blocking all-to-all in the supernode
        source=(
            "techpowerup.com/335749 (910C: 780 TFLOPS BF16, eight HBM2E stacks at 3200 GB/s); "
            "CloudMatrix384 analysis (chinaresearchcollective.substack.com/p/huawei-ascend-cloudmatrix-384-"
            "supernode): 48 TB HBM over 384 NPUs (128 GB each), UB 196 GB/s per NPU, non-blocking; figures per "
            "die are half a package's; UB per die and alpha 20 us assumed"
        ),
        memory_bytes=64 * GiB,
        links=1,
        node_size=None,  # the supernode's UB spans 384 packages: every group here is on it
        host_link=Link(bytes_per_s=25e9, alpha_s=20e-6),  # as the 910B's PCIe 4.0 x16 per die: assumed
        assumed=("link.bytes_per_s (per die)", "link.alpha_s", "host_link"),
        # fitted to two vllm-ascend deployments (Qwen3-32B W8A8 TP4, Qwen3-30B-A3B W8A8 TP1, end to end;
        # benchmarks/results/planner_published.json); spread: the held-out rows' median error (21%; the fit's
        # leave-one-out error is 3%)
        step_overhead_s=23.1e-3,
        spread=0.21,
    ),
    "h100-sxm": Device(
        "h100-sxm",
        memory_bytes_per_s=3.35e12,  # HBM3
        flop_per_s=989e12,  # BF16 dense (1979 with sparsity)
        # NVLink 4: 900 GB/s both directions, 450 one way; NCCL's app-level target 370 GB/s one way
        link=Link(bytes_per_s=370e9, alpha_s=10e-6),
        source=(
            "nvidia.com/en-us/data-center/h100 (80 GB, 3.35 TB/s, 1979 TFLOPS BF16 sparse, NVLink 900 GB/s); "
            "github.com/NVIDIA/nccl/issues/1442 (370 GB/s each direction); 400 Gb/s InfiniBand per GPU "
            "between nodes (DGX H100); alpha 10 us assumed"
        ),
        memory_bytes=80 * GiB,  # nvidia-smi: 81559 MiB, of which about 80 GiB usable
        links=1,
        node_size=8,
        inter_node=Link(bytes_per_s=50e9, alpha_s=30e-6),
        # PCIe 5.0 x16: 64 GB/s one way; 55.5 GB/s measured from pinned memory on a lent H200 (the same host link,
        # python -m benchmarks gpu, benchmarks/results/gpu.json runs 7 and 8); alpha 10 us assumed
        host_link=Link(bytes_per_s=55.5e9, alpha_s=10e-6),
        assumed=("link.alpha_s", "inter_node.alpha_s", "host_link.alpha_s"),
        # fitted to one deployment (LMSYS's DeepSeek-V3 decode on 72 H100s, priced under its two-batch overlap;
        # benchmarks/results/planner_published.json); one row gives no spread of its own: the held-out rows' median
        # error (21%)
        step_overhead_s=34.3e-3,
        spread=0.21,
        formats=("bf16", "fp16", "fp8", "int8", "int4"),
    ),
    "h200-sxm": Device(
        "h200-sxm",
        memory_bytes_per_s=4.8e12,  # HBM3e
        flop_per_s=989e12,  # BF16 dense, as the H100's (the same Hopper die)
        link=Link(bytes_per_s=370e9, alpha_s=10e-6),  # NVLink 4, as the H100's
        source=(
            "nvidia.com/en-us/data-center/h200 (141 GB HBM3e at 4.8 TB/s, 1979 TFLOPS BF16 sparse, NVLink 900 GB/s); "
            "143771 MiB and 55.5 GB/s pinned host-to-device copies measured on a lent H200 (python -m benchmarks "
            "gpu, benchmarks/results/gpu.json); links and alpha as the H100's, assumed"
        ),
        memory_bytes=143771 * 2**20,
        links=1,
        node_size=8,
        inter_node=Link(bytes_per_s=50e9, alpha_s=30e-6),
        host_link=Link(bytes_per_s=55.5e9, alpha_s=10e-6),
        # the H100's fitted fixed cost (the same host stack; no H200 deployment fitted): the held-out Kimi K2
        # decode on 96 H200s came within 14% with it (benchmarks/results/planner_published.json); no spread fitted
        step_overhead_s=34.3e-3,
        formats=("bf16", "fp16", "fp8", "int8", "int4"),
        assumed=("link.alpha_s", "inter_node", "host_link.alpha_s", "step_overhead_s"),
    ),
    "host": Device(
        "host",
        memory_bytes_per_s=17.5e9,  # fp32 matvec streaming rate measured by `bench` on a 2-core host
        flop_per_s=1.0e11,
        link=Link(bytes_per_s=1.0e9, alpha_s=1e-4),  # gloo over loopback TCP, two ranks on two cores
        source="measured on this project's 2-core CI-class host (python -m benchmarks bench)",
        memory_bytes=24 * 2**30,
        assumed=("flop_per_s",),
        overlap=False,  # layer-sharded k = 1 left 78-96% of its broadcasts exposed on gloo loopback
        # the fixed cost of a batch-1 float32 decode step beyond its weight reads, measured by the library's own
        # compiled runs (python -m benchmarks bench: benchmarks/results/bench.json, fixed_ms median 2.34)
        step_overhead_s=2.34e-3,
        formats=("fp32", "bf16", "int8", "int4"),
    ),
}
ALIASES = {
    "910b": "ascend-910b",
    "910c": "ascend-910c",
    "a3": "ascend-910c",
    "h100": "h100-sxm",
    "h200": "h200-sxm",
    "cpu": "host",
}


def device(name: str | Device) -> Device:
    """The profile named ``name`` (or one of :data:`ALIASES`); a :class:`Device` is returned as is.

    Raises:
        ValueError listing the known names.
    """
    if isinstance(name, Device):
        return name
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DEVICES:
        known = ", ".join(list(DEVICES) + [f"{a} ({t})" for a, t in ALIASES.items()])
        raise ValueError(f"device {name!r} is not known; choose one of {known}")
    return DEVICES[key]
