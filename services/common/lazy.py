"""A package that loads none of its modules when imported: its public names resolve on first
use (PEP 562), so that torch-free code can import its light modules (the engine's config, the
presets) without the package pulling in torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The package's module ``__getattr__``: ``exports`` maps each name to its module."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
