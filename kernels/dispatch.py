"""One dispatch point for every op the model calls.

Each op registers one implementation per backend (``torch`` is the reference and always present;
``triton`` kernels register themselves where they exist). The backend is chosen per call from the
tensor's device — Triton on CUDA, torch elsewhere — unless ``FERRY_KERNELS`` (``torch`` or
``triton``) or :func:`set_backend` forces one. This is the only place in Ferry that reads
``FERRY_KERNELS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

BACKENDS = ("auto", "torch", "triton")
_registry: dict[str, dict[str, Callable[..., Any]]] = {}
_forced: str = os.environ.get("FERRY_KERNELS", "auto").strip().lower() or "auto"
if _forced not in BACKENDS:
    raise ValueError(f"FERRY_KERNELS={_forced!r}: choose one of {', '.join(BACKENDS)}")


def register(op: str, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the ``backend`` implementation of ``op``."""
    if backend not in BACKENDS[1:]:
        raise ValueError(f"unknown kernel backend {backend!r}")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _registry.setdefault(op, {})[backend] = fn
        return fn

    return wrap


def set_backend(backend: str) -> None:
    """Force a backend for every op ("auto" restores the per-device choice)."""
    global _forced
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    _forced = backend


def get_backend() -> str:
    return _forced


def implementations(op: str) -> dict[str, Callable[..., Any]]:
    return dict(_registry.get(op, {}))


def resolve(op: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``op`` for tensors on ``device``."""
    impls = _registry.get(op)
    if not impls:
        raise KeyError(f"no kernel registered for op {op!r}")
    if _forced == "auto":
        want = "triton" if device.type == "cuda" and "triton" in impls else "torch"
    else:
        want = _forced
    if want not in impls:
        raise RuntimeError(f"op {op!r} has no {want!r} implementation (FERRY_KERNELS={_forced})")
    return impls[want]
