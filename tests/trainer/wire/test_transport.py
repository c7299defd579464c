"""Every transport implements the declared Transport interface, signature for signature."""

from __future__ import annotations

import inspect

import pytest

from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.wire.transport import Transport

METHODS = [name for name in vars(Transport) if not name.startswith("_")]


def test_the_interface_declares_the_data_path():
    assert sorted(METHODS) == ["close", "pull_into", "push"]


@pytest.mark.parametrize("transport", [DaemonClient, DataPlaneClient, LocalClient])
@pytest.mark.parametrize("method", METHODS)
def test_each_transport_has_the_declared_signature(transport, method):
    declared = inspect.signature(getattr(Transport, method))
    assert inspect.signature(getattr(transport, method)) == declared
