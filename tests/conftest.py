"""The repository's root goes at the end of sys.path, after site-packages. pytest's importlib
mode leaves it off (at the front, its folder names would shadow installed modules: ``kernels``
is also Hugging Face's), but processes a test spawns with multiprocessing copy this sys.path and
import the test's own module by name (``tests.integration...``)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)
