"""The installed packages before this repository's folders on sys.path.

Run from the repository root (`python -m pytest`, `python -m tests...` under torchrun), the root
is first on sys.path, and its folder `kernels/` (installed as ps_offload.kernels) hides PyPI's
`kernels`, which transformers (5.x) imports when its distribution is installed: `from kernels
import CUDAProperties` then fails inside transformers. Moving the root to the end keeps
`tests.helpers` importable and lets an installed package win its own name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def site_packages_first() -> None:
    """Moves every sys.path entry that is the repository root ('' and '.' included, from the
    root) behind the others, and forgets a `kernels` module already loaded from it."""
    here = [entry for entry in sys.path if Path(os.path.abspath(entry or ".")) == REPO]
    sys.path[:] = [entry for entry in sys.path if entry not in here] + here
    loaded = sys.modules.get("kernels")
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve().is_relative_to(REPO):
        del sys.modules["kernels"]
