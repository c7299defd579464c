"""A daemon on another "node", simulated on this machine: a network namespace joined to this
one by a veth pair (this side SUBNET.1, the namespace's SUBNET.2), where tc netem (or, on a
kernel without it, iptables and tbf) adds loss, delay and a rate limit, and a link taken down is
a partition. Needs root and iproute2; `unavailable()` says why not.
Used by `make soak` and tests/integration/test_network_faults.py; everything it creates is
removed on exit, and a leftover of a killed run is removed before it starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str:
    """ "" when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"ps-probe-{os.getpid()}"  # (a fixed name: two test workers probing at once, one of them skipped)
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass(frozen=True)
class Namespace:
    name: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    @property
    def launcher(self) -> tuple[str, ...]:
        """The command prefix that runs a process inside the namespace."""
        return ("ip", "netns", "exec", self.name)

    def partition(self, *, silent: bool = False) -> None:
        """Cuts the link: packets both ways are dropped, no connection is reset. `silent`:
        the link stays up and the namespace's replies are discarded (a blackhole route to
        this side), so a connect's SYN goes unanswered instead of failing at once, as across
        a switch that stopped forwarding."""
        if silent:
            _ip("netns", "exec", self.name, "ip", "route", "add", "blackhole", f"{self.host_ip}/32")
        else:
            _ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        _ip("netns", "exec", self.name, "ip", "route", "del", "blackhole", f"{self.host_ip}/32", check=False)
        _ip("link", "set", self.host_if, "up")

    def degrade(self, *, loss: float, delay_ms: int, rate: str) -> str:
        """Makes the link lossy and slow both ways; returns what was applied. tc netem where
        the kernel has it (delay and loss); else iptables' random drop in the namespace (loss)
        and a tbf rate limit (no delay: this kernel has no sch_netem)."""
        self.restore()
        netem = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss:.2%}", "rate", rate]
        if self._qdisc(*netem):
            return f"netem delay {delay_ms} ms, loss {loss:.1%}, rate {rate}, both ways"
        applied = [f"rate {rate} (tbf)"]
        self._qdisc("tbf", "rate", rate, "burst", "64kb", "latency", "400ms")
        if shutil.which("iptables"):
            drop = ["-m", "statistic", "--mode", "random", "--probability", f"{loss}", "-j", "DROP"]
            for chain in ("INPUT", "OUTPUT"):
                subprocess.run([*self.launcher, "iptables", "-A", chain, *drop], check=True, capture_output=True)
            applied.append(f"loss {loss:.1%} both ways (iptables)")
        return ", ".join(applied) + "; no delay (no sch_netem in this kernel)"

    def restore(self) -> None:
        """Removes what degrade applied."""
        for prefix, dev in (((), self.host_if), (self.launcher, self.ns_if)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if shutil.which("iptables"):
            for chain in ("INPUT", "OUTPUT"):
                subprocess.run([*self.launcher, "iptables", "-F", chain], capture_output=True)

    def _qdisc(self, *qdisc: str) -> bool:
        """Adds `qdisc` as the root of both ends; False (nothing added) if the kernel lacks it."""
        added = []
        for prefix, dev in (((), self.host_if), (self.launcher, self.ns_if)):
            done = subprocess.run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", *qdisc], capture_output=True)
            if done.returncode != 0:
                for prefix_, dev_ in added:
                    subprocess.run([*prefix_, "tc", "qdisc", "del", "dev", dev_, "root"], capture_output=True)
                return False
            added.append((prefix, dev))
        return True


@contextlib.contextmanager
def namespace(name: str = "ps-fault", subnet: str = "10.211.0") -> Iterator[Namespace]:
    ns = Namespace(name, f"{name}-h"[:15], f"{name}-n"[:15], f"{subnet}.1", f"{subnet}.2")
    _remove(ns)
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", ns.host_if, "type", "veth", "peer", "name", ns.ns_if)
        _ip("link", "set", ns.ns_if, "netns", ns.name)
        _ip("addr", "add", f"{ns.host_ip}/24", "dev", ns.host_if)
        _ip("link", "set", ns.host_if, "up")
        inside = ("netns", "exec", ns.name, "ip")
        _ip(*inside, "addr", "add", f"{ns.ns_ip}/24", "dev", ns.ns_if)
        _ip(*inside, "link", "set", ns.ns_if, "up")
        _ip(*inside, "link", "set", "lo", "up")
        yield ns
    finally:
        _remove(ns)


def _remove(ns: Namespace) -> None:
    _ip("link", "del", ns.host_if, check=False)  # takes its peer with it
    _ip("netns", "del", ns.name, check=False)
