"""The repository's root goes at the end of sys.path, after site-packages. pytest's importlib
mode leaves it off (at the front, its folder names would shadow installed modules: ``kernels``
is also Hugging Face's), but processes a test spawns with multiprocessing copy this sys.path and
import the test's own module by name (``tests.integration...``).

Engines and the clusters tests start run eagerly (``FERRY_ENFORCE_EAGER=1``): compiling the
decode graphs takes seconds to a minute per model. The tests of the compiled path ask for it
(``EngineConfig(enforce_eager=False)``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("FERRY_ENFORCE_EAGER", "1")

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)
