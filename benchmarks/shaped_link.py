"""A rate-limited loopback: a private network namespace whose ``lo`` runs through a token bucket.

Communication between local ranks then takes wire time at the chosen rate instead of CPU copies.
``shaped_command`` wraps a command so it starts in such a namespace (``unshare --net``, ``ip link set
lo up``, ``tc qdisc add dev lo root tbf rate R``); ``set_rate`` changes the rate from inside it, so a
run can measure its compute first and then match the link to it. Needs root (or user namespaces),
``ip`` and ``tc``; ``link_unavailable`` says in one line why not, where not.
"""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["link_unavailable", "rate_for", "set_rate", "shaped_command"]

# the bucket refills while the ranks compute, so a large one lets every broadcast start with a free burst;
# it must still hold the largest loopback packet (64 KiB with segmentation offload, plus headers)
_BURST = 96 * 1024
_QUEUE = "200ms"  # tbf latency: how long a packet may wait in the queue before it is dropped


def _tbf(verb: str, rate_bits: int) -> str:
    if not isinstance(rate_bits, int) or isinstance(rate_bits, bool) or rate_bits < 1_000_000:
        raise ValueError(f"link rate must be an integer of at least 1 Mbit/s (in bit/s), got {rate_bits!r}")
    return f"tc qdisc {verb} dev lo root tbf rate {rate_bits}bit burst {_BURST} latency {_QUEUE}"


def shaped_command(rate_bits: int, argv: list[str]) -> list[str]:
    """``argv`` run in a new network namespace whose loopback is up and limited to ``rate_bits`` per second."""
    setup = f'ip link set lo up && {_tbf("add", rate_bits)} && exec "$0" "$@"'
    return ["unshare", "--net", "sh", "-c", setup, *argv]


def set_rate(rate_bits: int) -> None:
    """Change the loopback's rate, from inside a namespace made by :func:`shaped_command`."""
    done = subprocess.run(_tbf("change", rate_bits).split(), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise RuntimeError(f"could not set the emulated link's rate to {rate_bits} bit/s: {why}")


def link_unavailable() -> str | None:
    """Why the emulated link cannot be made here (one line), or None when it can."""
    missing = [tool for tool in ("unshare", "tc", "ip") if shutil.which(tool) is None]
    if missing:
        return f"emulated link skipped: {', '.join(missing)} not found (install iproute2 / util-linux)"
    try:
        done = subprocess.run(shaped_command(10**9, ["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"emulated link skipped: {e}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"emulated link skipped: a private network namespace with tc is not permitted here ({why})"
    return None


def rate_for(layer_bytes: float, layer_compute_s: float) -> int:
    """The rate (bit/s) at which one layer's broadcast takes one layer's compute."""
    if layer_bytes <= 0 or layer_compute_s <= 0:
        raise ValueError(f"rate_for: needs positive bytes and seconds, got {layer_bytes}, {layer_compute_s}")
    return max(1_000_000, int(8 * layer_bytes / layer_compute_s))
