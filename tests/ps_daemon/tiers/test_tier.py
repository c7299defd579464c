"""The memory every arena and I/O buffer comes from (ps_offload.daemon.tiers.tier.aligned_empty),
as the kernel maps it: private, not shmem (O_DIRECT from shared anonymous memory moved 0.79x
DeepSpeed's bytes per second where private memory moved 1.09x: docs/benchmarks.md), page
aligned, zeroed, and asking for transparent huge pages from 2 MiB up."""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import pytest

from ps_offload.daemon.tiers.tier import HUGE_PAGE, PAGE, aligned_empty, arena_tensor

THP_MODES = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("nbytes", [1, PAGE + 1, HUGE_PAGE, 3 * HUGE_PAGE + 5])
def test_buffers_are_private_page_aligned_whole_pages_and_zeroed(nbytes):
    region, view = aligned_empty(nbytes)
    address = _address(region)
    assert address % PAGE == 0
    assert len(view) == -(-nbytes // PAGE) * PAGE
    assert not any(view)
    assert "sh" not in _vm_flags(address)  # shared anonymous memory is shmem: slower O_DIRECT


@pytest.mark.skipif(
    not THP_MODES.exists() or "[never]" in THP_MODES.read_text(), reason="this kernel gives no transparent huge pages"
)
def test_buffers_of_a_huge_page_or_more_ask_for_huge_pages_and_smaller_ones_do_not():
    large, _ = aligned_empty(HUGE_PAGE)
    small, _ = aligned_empty(HUGE_PAGE - PAGE)
    assert "hg" in _vm_flags(_address(large))  # MADV_HUGEPAGE
    assert "hg" not in _vm_flags(_address(small))


def test_an_arena_tensor_is_a_view_of_that_memory():
    tensor, view = arena_tensor(1000, 4096)
    tensor.fill_(1.5)
    assert bytes(view[:4]) == b"\x00\x00\xc0\x3f"  # 1.5 in fp32, little-endian
    assert "sh" not in _vm_flags(tensor.data_ptr())
