"""What a daemon owns alone on its host: its NVMe directory and its ports.

The directory is held with flock(2) on a lock file inside it: the kernel drops the lock when
the process ends, however it ends (a SIGKILLed daemon leaves nothing behind to clean up). The
ports are bound without SO_REUSEPORT, which gRPC would otherwise set, letting a second daemon
listen on the same port and answer half of the calls. A refusal names the other holder where
this host shows it (the lock file's note; the listening socket's process in /proc)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "ps-daemon.lock"


class DirectoryInUse(OSError):
    """Another live process holds the directory's lock."""


class DirectoryLock:
    """An exclusive hold on `directory` (which must exist) for this process's lifetime, or
    until release(). `note` is written into the lock file for the next one to read."""

    def __init__(self, directory: Path, *, key: str, note: str) -> None:
        self.path = directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process this host does not name"
            os.close(fd)
            raise DirectoryInUse(
                errno.EBUSY,
                f"{key} {directory} is in use by another ps-daemon ({holder}); two daemons on one directory "
                f"would serve and overwrite the same files: stop that one, or give this one another {key}",
            ) from None
        self._fd = fd
        self.note(note)

    def note(self, text: str) -> None:
        """Says who holds the lock (pid, ports), for a daemon refused later."""
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{text}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1


def listener_of(port: int) -> str:
    """Which process listens on TCP `port` on this host ("pid N: command line"), or "" when
    /proc does not show it (another user's process, another network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN; field 9 is the inode.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return ""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    return f"pid {proc.name}: {command.strip()[:200]}"
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return ""


def port_in_use(key: str, address: str, port: int) -> str:
    """The message for a port another process listens on."""
    holder = listener_of(port)
    who = f"by {holder}" if holder else "by another process"
    return (
        f"cannot listen on {address} ({key}): the port is in use {who}; stop it, or choose another port "
        f"(port 0 picks a free one)"
    )
