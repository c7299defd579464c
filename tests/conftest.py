"""Shared fixtures: real daemons as subprocesses on 127.0.0.1, port 0, in temporary dirs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ps_offload.daemon.local import LocalDaemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., LocalDaemon]]:
    """Starts daemons (extra `ps-daemon serve` flags, an optional config file) and kills
    whatever is still running at the end of the test."""
    started: list[LocalDaemon] = []

    def factory(*extra: str, config: Path | None = None) -> LocalDaemon:
        flags = [*extra, *(["--config", str(config)] if config is not None else [])]
        daemon = LocalDaemon(tmp_path / f"daemon{len(started)}", *flags)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        daemon.kill()


@pytest.fixture
def daemon(daemon_factory) -> LocalDaemon:
    return daemon_factory()
