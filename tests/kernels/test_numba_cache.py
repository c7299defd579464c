"""kernels/numba_cache.py: where Numba caches when it would find nowhere (the daemon's start
with no writable home: tests/integration/test_no_writable_home.py)."""

from __future__ import annotations

import os
import stat

from ps_offload.kernels import numba_cache


def test_a_private_directory_is_this_users_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(numba_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    mine = numba_cache._private_directory()
    assert mine == tmp_path / f"ps-offload-numba-{os.getuid()}"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    mine.chmod(0o777)  # opened to others (anyone could plant code there): not used
    other = numba_cache._private_directory()
    assert other != mine and other.parent == tmp_path and stat.S_IMODE(other.stat().st_mode) == 0o700
