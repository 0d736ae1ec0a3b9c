"""A stand-in for a GPU's stream module (``torch.cuda``'s ``current_stream``, ``Stream``, ``Event``, ``stream``) that
records each call, so that a side stream's fork and join run on the CPU (:mod:`functional_npu.core.side_copy`)."""

from __future__ import annotations

import contextlib

import torch


class Stream:
    def __init__(self, api: Device, name: str) -> None:
        self.api, self.name = api, name

    def wait_event(self, event: Event) -> None:
        self.api.log.append(("wait", self.name, event.name))


class Event:
    def __init__(self, api: Device, name: str) -> None:
        self.api, self.name, self.recorded_on = api, name, None

    def record(self, stream: Stream) -> None:
        self.recorded_on = stream.name
        self.api.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return self.recorded_on is not None


class Device:
    """``torch.cuda``'s stream API as :func:`side_copy` uses it, recording each call in ``log``."""

    def __init__(self, reuse_main: bool = False) -> None:
        self.log: list[tuple] = []
        self.main = Stream(self, "main")
        self.current = self.main
        self.reuse_main = reuse_main  # the counterexample: a "side" stream that is the compute stream
        self.made = 0

    def current_stream(self, device: torch.device) -> Stream:
        return self.current

    def Stream(self, device: torch.device) -> Stream:  # noqa: N802 - torch.cuda's name
        self.made += 1
        return self.main if self.reuse_main else Stream(self, f"side{self.made}")

    def Event(self) -> Event:  # noqa: N802 - torch.cuda's name
        return Event(self, f"e{sum(1 for x in self.log if x[0] == 'record')}")

    @contextlib.contextmanager
    def stream(self, s: Stream):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before
