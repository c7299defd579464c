"""The one part of the trainer that only an accelerator (a CUDA GPU) runs: copies between
device and pinned host memory on side streams, ordered after the compute stream's work by an
event. Written against torch's device-generic Stream and Event, so any torch accelerator fits,
with one CUDA refinement (below); tests/trainer/io/test_accelerator.py runs it where there is one
and is skipped elsewhere.

One side stream per direction: a pull's host-to-device copy does not queue behind a push's
device-to-host copy (or a push's compression, `following`), and the two overlap on the
device's two copy engines.

A copy returns only when it is complete (the calling thread, one of the optimizer's I/O
threads, waits on the copy's event; the wait releases the GIL): the host buffer is then free
for the next shard, and whatever the compute stream queues afterwards sees the new values.
The wait blocks the thread instead of spinning a core: on CUDA the event is made with
cudaEventBlockingSync (`torch.cuda.Event(blocking=True)`; torch.Event takes `blocking` but
ignores it, torch 2.11 to 2.13), so the thread sleeps in the driver until the copy is done.
Elsewhere the backend's own event wait is used.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)


def _side_stream(device: torch.device) -> torch.Stream:
    # torch.cuda.Stream is a torch.Stream, and the blocking CUDA event can be recorded on it.
    return torch.cuda.Stream(device) if device.type == "cuda" else torch.Stream(device=device)


@contextlib.contextmanager
def _current(stream: torch.Stream) -> Iterator[None]:
    """`stream` as the calling thread's current stream for the block. Not `with stream:`: a
    torch.Stream keeps the context it restores on the object itself and refuses a second
    entry, and several I/O threads use one side stream at once."""
    device = torch.accelerator.current_device_index()
    previous = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)  # (also makes its device the current one)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)
        torch.accelerator.set_device_index(device)


class AcceleratorCopies:
    """Host <-> device copies of `device`, on one side stream per direction."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.to_host_stream = _side_stream(device)
        self.to_device_stream = _side_stream(device)

    def mark_compute(self, device: torch.device) -> torch.Event:
        """An event after the work queued on the device's current (compute) stream of the
        calling thread: take it on the training thread."""
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        return event

    def _finished(self, stream: torch.Stream) -> None:
        """Blocks the calling thread until `stream`'s work queued so far is done."""
        if self.device.type == "cuda":
            done = torch.cuda.Event(blocking=True)
        else:
            done = torch.Event(device=self.device)
        done.record(stream)
        done.synchronize()

    def _copy(
        self, stream: torch.Stream, source: torch.Tensor, target: torch.Tensor, after: torch.Event | None
    ) -> None:
        if after is not None:
            stream.wait_event(after)
        with _current(stream):
            target.copy_(source, non_blocking=True)
        self._finished(stream)

    def to_host(self, source: torch.Tensor, host: torch.Tensor, after: torch.Event | None) -> None:
        self._copy(self.to_host_stream, source, host, after)

    def to_device(self, host: torch.Tensor, target: torch.Tensor, after: torch.Event | None) -> None:
        self._copy(self.to_device_stream, host, target, after)

    @contextlib.contextmanager
    def following(self, after: torch.Event | None) -> Iterator[None]:
        """Runs the block's device work (a push's compression: kernels, then the copy of the
        compressed bytes to the host) on the push side stream, after `after`, and returns
        once it is complete. An I/O thread's current stream is the default stream, not the
        compute stream: without this its kernels could read gradients backward is still
        writing on a non-default compute stream."""
        stream = self.to_host_stream
        if after is not None:
            stream.wait_event(after)
        try:
            with _current(stream):
                yield
        finally:
            self._finished(stream)


def register_host(host: torch.Tensor) -> bool:
    """Page-locks `host`, memory CUDA did not allocate (a window shared with the node's daemon,
    ps_offload.trainer.wire.host_windows), so the device's copies go straight to and from it
    as they do with pin_memory's buffers: cudaHostRegister, portable to every device. Whether
    it took; where it did not (no CUDA, the driver refused), the caller keeps its own pinned
    buffers. The caller unregisters it (unregister_host) before the memory is unmapped."""
    if not torch.cuda.is_available():
        return False
    nbytes = host.numel() * host.element_size()
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
    except (AssertionError, RuntimeError) as exc:
        log.warning("cannot page-lock %d bytes shared with the node's daemon: %s", nbytes, exc)
        return False
    if code:
        log.warning(
            "cannot page-lock %d bytes shared with the node's daemon: cudaHostRegister returned %d", nbytes, code
        )
        return False
    return True


def unregister_host(address: int) -> None:
    """Undoes register_host for the memory at `address` (before it is unmapped: a new
    mapping at the same address could not be registered again)."""
    code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code:
        log.warning("cudaHostUnregister of %#x returned %d", address, code)
