"""Whether a replicated model's lost daemons answer again, asked off the training thread.

A holder left out (ReplicaHolders.lose, trainer/wire/holders.py) may come back: a replacement at its address, the same
node with its disk wiped, or its old self restarted from its disk. Asking costs a
registration attempt, and an address that is gone for good answers nothing: the attempt waits
out its whole timeout. Asked on the training thread, before a step's pushes, that wait was a
stall every REPAIR_PROBE_SECONDS for the rest of the run (issue 39: 2 s of every 5 s).

So one thread of its own asks each lost daemon every REPAIR_PROBE_SECONDS, and keeps the
last answer; the repair between two steps (trainer/wire/replicas.py repair_lost) takes an
answer that is there and never waits for one. A daemon expected to answer now (a replacement
the user has just named, `replace_daemon`; one that answered the run's registration,
ReplicaHolders.adopt_fresh; one whose network the operator has just healed) is asked once on the
training thread instead, at the next step boundary, so that it is caught up there as the
user expects (`expect`).

The probe registers the model on the daemon (RegisterModel is idempotent; a replacement
learns the model from it, with no values until the repair copies them), through a gRPC
channel of its own per address, and with its own copy of the spec: the training thread's may
change (replace_daemon) while a question is under way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from ps_offload.proto import ps_pb2
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonClient

log = logging.getLogger(__name__)

REPAIR_PROBE_SECONDS = 5.0
"""How often a lost daemon is asked whether it answers again."""
PROBE_TIMEOUT_SECONDS = 2.0
"""How long one question waits for an answer."""


@dataclass
class _Watched:
    address: str
    spec: ps_pb2.ModelSpec  # this probe's own copy
    client: DaemonClient
    due: float  # time.monotonic() of the next question
    expected: bool  # the next take asks on its own thread
    answer: ps_pb2.RegisterModelResponse | None = None


class LostDaemonProbe:
    """Asks the watched daemons (index -> address) in the background; answers are taken once."""

    def __init__(self, config: ClientConfig, *, interval: float = REPAIR_PROBE_SECONDS) -> None:
        self.config = config
        self.interval = interval
        self._lock = threading.Condition()
        self._watched: dict[int, _Watched] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.questions = 0  # asked so far, on either thread (for tests and metrics)

    def watch(self, index: int, address: str, spec: ps_pb2.ModelSpec, *, expect: bool = False) -> None:
        """Starts (or restarts, at a new address) asking daemon `index`: the first question
        comes after `interval` (it has just stopped answering), or, with `expect`, at the
        next `take`."""
        copy = ps_pb2.ModelSpec()
        copy.CopyFrom(spec)
        with self._lock:
            if self._closed:
                return
            old = self._watched.pop(index, None)
            due = time.monotonic() + self.interval
            self._watched[index] = _Watched(address, copy, self._client(address), due, expect)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ps-lost-probe", daemon=True)
                self._thread.start()
            self._lock.notify_all()
        if old is not None:
            old.client.close()

    def forget(self, index: int) -> None:
        """Stops asking daemon `index` (repaired, or its run is over)."""
        with self._lock:
            old = self._watched.pop(index, None)
        if old is not None:
            old.client.close()

    def expect(self, index: int) -> None:
        """Daemon `index` should answer now (the operator restarted or reconnected it): the
        next `take` asks it on its own thread."""
        with self._lock:
            watched = self._watched.get(index)
            if watched is not None:
                watched.expected = True

    def take(self, index: int) -> ps_pb2.RegisterModelResponse | None:
        """Daemon `index`'s answer for a repair, taken (the next call has a newer one or
        None): asked on the calling thread, waiting up to PROBE_TIMEOUT_SECONDS, if it is
        expected to answer now; else the background's latest, None while it has not
        answered since."""
        with self._lock:
            watched = self._watched.get(index)
            if watched is None:
                return None
            expected, watched.expected = watched.expected, False
            answer, watched.answer = watched.answer, None
        if not expected:
            return answer
        response = self._ask(index, watched)
        with self._lock:
            watched.due = time.monotonic() + self.interval
        return response

    def _client(self, address: str) -> DaemonClient:
        return DaemonClient(
            address,
            max_message_bytes=self.config.max_message_bytes,
            security=self.config.security,
            dead_peer_seconds=self.config.dead_peer_seconds,
        )

    def _ask(self, index: int, watched: _Watched) -> ps_pb2.RegisterModelResponse | None:
        with self._lock:
            self.questions += 1
        try:
            return watched.client.register(watched.spec, index, timeout=PROBE_TIMEOUT_SECONDS)
        except (grpc.RpcError, ValueError) as error:  # ValueError: its channel closed meanwhile
            log.debug("lost daemon %s still does not answer: %s", watched.address, error)
            return None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    now = time.monotonic()
                    due = [(i, w) for i, w in self._watched.items() if w.due <= now]
                    if due:
                        break
                    soonest = min((w.due for w in self._watched.values()), default=now + self.interval)
                    self._lock.wait(timeout=max(0.01, soonest - now))
                if self._closed:
                    return
                for _, watched in due:
                    watched.due = time.monotonic() + self.interval
            for index, watched in due:
                response = self._ask(index, watched)
                with self._lock:
                    if response is not None and self._watched.get(index) is watched:
                        watched.answer = response

    def close(self) -> None:
        with self._lock:
            self._closed = True
            watched, self._watched = list(self._watched.values()), {}
            self._lock.notify_all()
        for each in watched:
            each.client.close()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT_SECONDS + 5.0)
