"""HostWindows (trainer/wire/host_windows.py) on its own: a window is offered to every attacher
and kept only where one took it, and buffers are found by address, in a window or in a block
mapped to a slot of a SlotRegion (trainer/wire/slot_region.py)."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire.host_windows import HostWindows


def test_a_window_nobody_takes_is_not_kept():
    windows = HostWindows()
    assert windows.allocate(1024, torch.float32) is None  # no daemon attached
    windows.add_attacher(lambda window: False)
    assert windows.allocate(1024, torch.float32) is None and windows.windows == []


def test_buffers_are_found_by_address():
    windows = HostWindows()
    offered = []
    windows.add_attacher(lambda window: offered.append(window) or True)
    values = windows.allocate(8 << 20, torch.float32)  # 32 MiB
    assert values is not None and len(offered) == 1 and torch.equal(values, torch.zeros(8 << 20))
    ref = windows.find(byte_view(values[1024:2048]))
    assert (ref.window, ref.offset, ref.nbytes) == (1, 4096, 4096)
    assert windows.find(byte_view(torch.zeros(16))) is None


PAGE = mmap.PAGESIZE


def test_blocks_take_slots_at_their_own_addresses_and_hand_the_pages_on():
    windows = HostWindows()
    offered = []
    windows.add_attacher(lambda window: offered.append(window) or True)
    block = 3 * PAGE  # three blocks of three pages over two slots
    region = windows.slot_region(3 * block, slots=2, slot_bytes=block)
    assert region is not None and len(offered) == 1 and offered[0].nbytes == 2 * block
    linear = (ctypes.c_uint8 * (2 * block)).from_address(offered[0].address)  # the memfd, as the daemon maps it
    seen_by_daemon = torch.frombuffer(linear, dtype=torch.uint8)
    blocks = [region.bytes[i * block : (i + 1) * block] for i in range(3)]
    addresses = [b.data_ptr() for b in blocks]
    assert region.fetch(blocks[0]) and region.fetch(blocks[1])
    assert not region.fetch(blocks[2])  # no slot free: the private reserve at its address
    blocks[0].fill_(7)
    blocks[1].fill_(9)
    assert seen_by_daemon[:block].eq(7).all() and seen_by_daemon[block:].eq(9).all()  # slots 0 and 1
    ref = windows.find(byte_view(blocks[1][PAGE : 2 * PAGE]))
    assert (ref.window, ref.offset, ref.nbytes) == (offered[0].number, block + PAGE, PAGE)
    assert windows.find(byte_view(blocks[2])) is None  # in the reserve: through the connection's slot
    blocks[2].fill_(3)  # usable all the same
    region.release(blocks[2])
    region.release(blocks[0])
    assert not blocks[0].any()  # the reserve is back at its address
    assert region.fetch(blocks[2])  # slot 0, its pages as block 0 left them: not given back and zeroed
    assert blocks[2].eq(7).all() and windows.find(byte_view(blocks[2])).offset == 0
    assert [b.data_ptr() for b in blocks] == addresses  # the tensors never moved
    assert region.stats == {"slot_fetches": 3, "reserve_fetches": 1}
    with pytest.raises(ValueError, match="page-aligned"):
        region.fetch(region.bytes[100:200])


def test_a_slot_region_nobody_takes_is_not_kept():
    windows = HostWindows()
    windows.add_attacher(lambda window: False)
    assert windows.slot_region(4 * PAGE, slots=1, slot_bytes=PAGE) is None and windows.windows == []
