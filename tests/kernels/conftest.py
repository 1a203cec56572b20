"""The Triton kernel tests run under Triton's CPU interpreter, which has to be switched on
(``TRITON_INTERPRET=1``) before Triton defines any kernel. So that the rest of the suite keeps
running in one process untouched (and never imports Triton), each ``test_triton_*.py`` module
collected without the interpreter becomes one test that runs that module in a fresh pytest
process with it; inside that process (or when the caller set ``TRITON_INTERPRET=1`` already) the
module's tests are collected as usual.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED_TIMEOUT_S = 600


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    if module_path.name.startswith("test_triton_") and os.environ.get("TRITON_INTERPRET") != "1":
        return InterpretedModule.from_parent(parent, path=module_path)
    return None


class InterpretedModule(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        run = InterpretedRun.from_parent(self, name="under_TRITON_INTERPRET")
        if _marked_slow(self.path):  # `make test-slow`'s, as the module's own tests are
            run.add_marker(pytest.mark.slow)
        yield run


def _marked_slow(path: Path) -> bool:
    """The module says ``pytestmark = pytest.mark.slow`` (read, not imported: importing it
    would define its kernels without the interpreter)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return ast.unparse(node.value) == "pytest.mark.slow"
    return False


class InterpretedFailure(Exception):
    """The inner pytest run failed; its output is the report."""


class InterpretedRun(pytest.Item):
    def runtest(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env.pop("FERRY_KERNELS", None)  # the tests pick backends themselves
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(self.path)]
        run = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=INTERPRETED_TIMEOUT_S
        )
        if run.returncode != 0:
            raise InterpretedFailure(
                f"{' '.join(cmd)} exited {run.returncode}\n{run.stdout}{run.stderr}"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, InterpretedFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name} under TRITON_INTERPRET=1"
