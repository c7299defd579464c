"""HostWindows (trainer/wire/host_windows.py) on its own: a window is offered to every attacher
and kept only where one took it, buffers are found by address, and free_pages gives a
streamed block's memory back to the kernel while its mapping stays."""

from __future__ import annotations

import torch

from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire.host_windows import HostWindows


def _resident_bytes(address: int) -> int:
    """Rss of the mapping that starts at `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_window_nobody_takes_is_not_kept():
    windows = HostWindows()
    assert windows.allocate(1024, torch.float32) is None  # no daemon attached
    windows.add_attacher(lambda window: False)
    assert windows.allocate(1024, torch.float32) is None and windows.windows == []


def test_buffers_are_found_by_address_and_their_pages_given_back():
    windows = HostWindows()
    offered = []
    windows.add_attacher(lambda window: offered.append(window) or True)
    values = windows.allocate(8 << 20, torch.float32)  # 32 MiB
    assert values is not None and len(offered) == 1 and torch.equal(values, torch.zeros(8 << 20))
    ref = windows.find(byte_view(values[1024:2048]))
    assert (ref.window, ref.offset, ref.nbytes) == (1, 4096, 4096)
    assert windows.find(byte_view(torch.zeros(16))) is None
    values.fill_(1.5)
    address = offered[0].address
    assert _resident_bytes(address) >= 32 << 20
    assert windows.free_pages(values)
    assert _resident_bytes(address) < 1 << 20  # the memory went back to the kernel
    assert not values.any()  # it reads as zeros
    values[:10].fill_(2.0)  # and takes memory again as it is written
    assert values[:10].eq(2.0).all() and _resident_bytes(address) >= 4096
    assert not windows.free_pages(torch.ones(16))  # not in a window
