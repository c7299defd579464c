"""A disk cache for Numba's compiled kernels wherever the daemon or a trainer runs.

The kernels here are compiled with `cache=True`, and Numba refuses to import such a function
("cannot cache function ...: no locator available") when it finds nowhere to write: not
NUMBA_CACHE_DIR, not a `__pycache__` beside the source (a package installed read-only), not
the user's cache directory (a service user with no writable home). Rather than die there,
this picks a directory of the process's own under the temporary directory, checked to be
owned by this user and closed to others (Numba loads what it finds there as code), and says
so once. The systemd unit sets NUMBA_CACHE_DIR itself, and so may any recipe.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return False
    return True


def _private_directory() -> Path:
    """/tmp/ps-offload-numba-<uid>, made 0700 when missing; a fresh one when that name is
    taken by something this user does not own alone."""
    path = Path(tempfile.gettempdir()) / f"ps-offload-numba-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        found = path.lstat()
        if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and not found.st_mode & 0o077:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="ps-offload-numba-"))


def ensure_numba_cache() -> None:
    """Sets NUMBA_CACHE_DIR when Numba would find nowhere to cache (see above)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    beside_source = Path(__file__).parent / "__pycache__"
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "numba"
    if _writable(beside_source) or _writable(user_cache):
        return
    chosen = str(_private_directory())
    os.environ["NUMBA_CACHE_DIR"] = chosen
    if "numba" in sys.modules:  # (its config read the environment when it was imported)
        sys.modules["numba"].config.CACHE_DIR = chosen
    log.warning(
        "Numba's kernel cache: %s is read-only and %s cannot be written (no writable home?); caching in %s "
        "(set NUMBA_CACHE_DIR to choose)",
        beside_source,
        user_cache,
        chosen,
    )
