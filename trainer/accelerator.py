"""The one part of the trainer that only an accelerator (a CUDA GPU) runs: copies between
device and pinned host memory on a side stream, ordered after the compute stream's work by an
event. Written against torch's device-generic Stream and Event, so any torch accelerator fits;
tests/trainer/test_accelerator.py runs it where there is one and is skipped elsewhere.

A copy returns only when it is complete (the calling thread, one of the optimizer's I/O
threads, waits on the copy's event; the wait releases the GIL): the host buffer is then free
for the next shard, and whatever the compute stream queues afterwards sees the new values.
"""

from __future__ import annotations

import torch


class AcceleratorCopies:
    """Host <-> device copies on one side stream of `device`."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.Stream(device=device)

    def mark_compute(self, device: torch.device) -> torch.Event:
        """An event after the work queued on the device's current (compute) stream."""
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        return event

    def _copy(self, source: torch.Tensor, target: torch.Tensor, after: torch.Event | None) -> None:
        if after is not None:
            self.stream.wait_event(after)
        with self.stream:
            target.copy_(source, non_blocking=True)
            done = torch.Event(device=self.stream.device)
            done.record(self.stream)
        done.synchronize()

    def to_host(self, source: torch.Tensor, host: torch.Tensor, after: torch.Event | None) -> None:
        self._copy(source, host, after)

    def to_device(self, host: torch.Tensor, target: torch.Tensor, after: torch.Event | None) -> None:
        self._copy(host, target, after)
