"""The repository's root goes at the end of sys.path, after site-packages. pytest's importlib
mode leaves it off (at the front, its folder names would shadow installed modules: ``kernels``
is also Hugging Face's), but processes a test spawns with multiprocessing copy this sys.path and
import the test's own module by name (``tests.integration...``).

Engines and the clusters tests start run eagerly (``FERRY_ENFORCE_EAGER=1``): compiling the
decode graphs takes seconds to a minute per model. The tests of the compiled path ask for it
(``EngineConfig(enforce_eager=False)``).

The fixtures that many modules share live here: a real ``redis`` server per module, and the
random ``checkpoint`` a module names (``CHECKPOINT = Checkpoint(seed=...)``), each written
once a session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.redis_server import RedisServer, redis_server

if TYPE_CHECKING:
    from tests.helpers import Checkpoint

os.environ.setdefault("FERRY_ENFORCE_EAGER", "1")

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for the module's tests (``restart()`` empties
    it). Tests that must not see each other's records use clusters of their own names."""
    with redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Checkpoint], Path]:
    """The path of a random ``Checkpoint`` (tests/helpers.py), written the first time a test
    asks for it and shared after: no test may change its files (copy it first)."""
    written: dict[str, Path] = {}

    def path(spec: Checkpoint) -> Path:
        if spec.key not in written:
            folder = tmp_path_factory.mktemp(f"ckpt-{spec.family}-seed{spec.seed}")
            written[spec.key] = spec.write(folder)
        return written[spec.key]

    return path


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest, checkpoints: Callable[[Checkpoint], Path]) -> Path:
    """The checkpoint the test module names as ``CHECKPOINT`` (or, parametrized indirectly, the
    test's own)."""
    spec = getattr(request, "param", None) or getattr(request.module, "CHECKPOINT", None)
    assert spec is not None, f"{request.module.__name__} names no CHECKPOINT = Checkpoint(...)"
    return checkpoints(spec)
