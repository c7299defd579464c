"""The allocator settings of ps_proto/memory.py, each in a fresh interpreter (they are
process-wide, and a heap that already holds free chunks would serve a block from them): a
block freed under keep_chunk_buffers_in_heap stays resident (the wire's chunk buffers are
reused without faults); under return_freed_blocks it goes back to the kernel at once (a
streamed trainer's memory follows what it holds; trainer/stream/optimizer.py)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and /proc/self/status"
)

PROBE = """
import ctypes, json, sys
from ps_offload.proto import memory

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
given_back = {}
for setting in sys.argv[1:]:
    assert getattr(memory, setting)()
    block = libc.malloc(24 << 20)
    ctypes.memset(block, 1, 24 << 20)
    live = libc.malloc(64)  # above the block, so a heap could not trim it from its top either
    with_it = anon_kib()
    libc.free(block)
    given_back[setting] = (with_it - anon_kib()) >> 10  # MiB
    libc.free(live)
print(json.dumps(given_back))
"""


def _given_back(*settings: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, *settings], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_freed_block_stays_in_the_heap_for_the_wire_and_goes_back_for_a_streamed_trainer():
    given_back = _given_back("keep_chunk_buffers_in_heap", "return_freed_blocks")
    assert given_back["keep_chunk_buffers_in_heap"] < 4
    assert given_back["return_freed_blocks"] >= 20


def test_a_later_bulk_stream_setting_does_not_undo_a_streamed_trainers():
    """A client connecting after the streamed optimizer started (DaemonClient calls
    keep_chunk_buffers_in_heap) leaves freed blocks going back."""
    assert _given_back("return_freed_blocks", "keep_chunk_buffers_in_heap")["keep_chunk_buffers_in_heap"] >= 20
