"""Reading the prefetch timeline back out of inductor's generated code: a check of what the compiler emitted.

Used by the demo, the tests and the prefetch benchmark to verify
:class:`functional_npu.parallel.schedule.PrefetchSchedule` (issue ``k`` layers ahead, wait at first use, at most
``k + 1`` live buffers) on the real output.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["prefetch_timeline"]

_BUF = r"(buf\d+|arg\d+_\d+)"


def prefetch_timeline(code: str) -> dict[str, Any]:
    """Read the prefetch timeline out of inductor's generated code (the ``call()`` of one graph).

    A check of what the compiler really emitted, for tests and benchmarks.

    Returns ``{"issue": {buf: line}, "wait": {buf: line}, "use": {buf: line}, "live_max": n}``:
    the line of each broadcast, of each wait on a prefetched (broadcast or carried) buffer, of the
    first other line that reads it, and the most prefetch buffers alive at once (from the issue, or
    the start for carried inputs, to inductor's ``del`` of the buffer; a buffer reused for the next
    broadcast dies when it is reused).
    """
    body = code.split("def call(self, args):")[1]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    issue, wait, use = {}, {}, {}
    for i, ln in enumerate(lines):
        m = re.match(rf"torch\.ops\._c10d_functional\.broadcast_\.default\({_BUF},", ln)
        if m:
            issue[m.group(1)] = i
        m = re.match(rf"torch\.ops\._c10d_functional\.wait_tensor\.default\({_BUF}\)", ln)
        if m and (m.group(1) in issue or m.group(1).startswith("arg")):
            wait[m.group(1)] = i
    for b, w in wait.items():
        later = [
            i
            for i in range(w + 1, len(lines))
            if re.search(rf"\b{b}\b", lines[i]) and not lines[i].startswith(("del ", "return"))
        ]
        if later:
            use[b] = later[0]
    live, peak = {b for b in wait if b.startswith("arg")}, 0
    for i, ln in enumerate(lines):
        for b, t in issue.items():
            if t == i:
                live.add(b)
        peak = max(peak, len(live))
        for dead in re.findall(rf"(?:^|; )del {_BUF}", ln):  # "del bufX", or "bufY = ...; del bufX  # reuse"
            live.discard(dead)
    kernels = [
        i
        for i, ln in enumerate(lines)
        if re.match(r"(extern_kernels\.|cpp_fused|torch\.ops\.|buf\d+ = torch\.ops\.)", ln)
    ]
    return {"issue": issue, "wait": wait, "use": use, "live_max": peak, "kernels": kernels}
