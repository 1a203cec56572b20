"""One dispatch point for every op the model calls.

Each op registers one implementation per backend (``torch`` is the reference and always present;
``triton`` kernels, and the ``native`` C kernels some ops have for the CPU, are declared with
:func:`register_lazy` and imported on first use, so that ``import kernels`` never imports Triton
nor builds C). The backend is chosen per call from the tensor's device — Triton on CUDA, native
on the CPU where the op has one, torch elsewhere — unless ``FERRY_KERNELS`` (``torch``,
``triton`` or ``native``) or :func:`set_backend` forces one; ``FERRY_KERNELS=torch`` is the
switch that turns the fast CPU path off. Forcing ``triton`` on CPU tensors runs the kernels under
Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before they are
defined. This is the only place in Ferry that reads ``FERRY_KERNELS`` and ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "torch", "triton", "native")
# the backend "auto" picks on each device type, where the op has it and it loads
_PREFERRED = {"cuda": "triton", "cpu": "native"}
_forced: str = os.environ.get("FERRY_KERNELS", "auto").strip().lower() or "auto"
if _forced not in BACKENDS:
    raise ValueError(f"FERRY_KERNELS={_forced!r}: choose one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class _Lazy:
    """An implementation not imported yet: importing ``module`` registers it."""

    module: str


_registry: dict[str, dict[str, Callable[..., Any] | _Lazy]] = {}
_unloadable: dict[str, str] = {}  # module -> why its import failed (asked for once)


def register(op: str, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the ``backend`` implementation of ``op``."""
    _check_backend(backend)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _registry.setdefault(op, {})[backend] = fn
        return fn

    return wrap


def register_lazy(op: str, backend: str, module: str) -> None:
    """Declare that importing ``module`` registers the ``backend`` implementation of ``op``;
    the import happens the first time a call picks that backend."""
    _check_backend(backend)
    _registry.setdefault(op, {}).setdefault(backend, _Lazy(module))


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS[1:]:
        raise ValueError(f"unknown kernel backend {backend!r}")


def set_backend(backend: str) -> None:
    """Force a backend for every op ("auto" restores the per-device choice)."""
    global _forced
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    _forced = backend


def get_backend() -> str:
    return _forced


def implementations(op: str) -> dict[str, Callable[..., Any]]:
    """The implementations of ``op`` imported so far (lazy ones appear once loaded)."""
    return {b: fn for b, fn in _registry.get(op, {}).items() if not isinstance(fn, _Lazy)}


def backends(op: str) -> tuple[str, ...]:
    """Every backend ``op`` has, imported or not."""
    return tuple(_registry.get(op, {}))


def implementation(op: str, backend: str) -> Callable[..., Any]:
    """The ``backend`` implementation of ``op``, importing it if needed (benchmarks and tests)."""
    impls = _registry.get(op, {})
    if backend not in impls:
        raise RuntimeError(f"op {op!r} has no {backend!r} implementation (FERRY_KERNELS={_forced})")
    entry = impls[backend]
    if isinstance(entry, _Lazy):
        _import(entry.module)
        entry = impls[backend]
        if isinstance(entry, _Lazy):
            raise RuntimeError(f"importing {entry.module} did not register {op!r} ({backend})")
    return entry


def resolve(op: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``op`` for tensors on ``device``."""
    impls = _registry.get(op)
    if not impls:
        raise KeyError(f"no kernel registered for op {op!r}")
    if _forced == "auto":
        fast = _PREFERRED.get(device.type)
        want = fast if fast is not None and _usable(impls, fast) else "torch"
    else:
        want = _forced
    if want == "native" and want not in impls:
        want = "torch"  # forced native: the C kernels where an op has one, torch for the rest
    if want not in impls:
        raise RuntimeError(f"op {op!r} has no {want!r} implementation (FERRY_KERNELS={_forced})")
    if want == "triton" and device.type == "cpu" and not interpreting():
        raise RuntimeError(
            f"op {op!r}: Triton kernels run on CPU tensors only under Triton's interpreter; set "
            "TRITON_INTERPRET=1 in the environment before the process starts (Triton reads it "
            "when the kernels are defined), or use FERRY_KERNELS=torch"
        )
    if want == "native" and device.type != "cpu":
        raise RuntimeError(
            f"op {op!r}: the native kernels run on CPU tensors, not {device.type}; use "
            "FERRY_KERNELS=auto or triton"
        )
    entry = impls[want]
    return implementation(op, want) if isinstance(entry, _Lazy) else entry


def interpreting() -> bool:
    """Whether Triton kernels defined from now on run under Triton's (CPU) interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _usable(impls: dict[str, Callable[..., Any] | _Lazy], backend: str) -> bool:
    """For "auto": is there a ``backend`` implementation that imports? A broken Triton install
    or a C kernel that does not build falls back to torch with one warning instead of failing
    every forward."""
    entry = impls.get(backend)
    if entry is None:
        return False
    if not isinstance(entry, _Lazy):
        return True
    if entry.module not in _unloadable:
        try:
            _import(entry.module)
        except RuntimeError as exc:
            warnings.warn(f"{exc}; using the torch kernels", RuntimeWarning, stacklevel=3)
    return entry.module not in _unloadable


def _import(module: str) -> None:
    if module in _unloadable:
        raise RuntimeError(_unloadable[module])
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken Triton install can raise anything, not only ImportError
        hint = " (is Triton installed?)" if module.endswith("triton_kernel") else ""
        _unloadable[module] = f"cannot import {module}{hint}: {exc!r}"
        raise RuntimeError(_unloadable[module]) from exc
