"""C kernels for the CPU, compiled on first use for the machine they run on.

A kernel's source lives beside its op (``kernels/<op>/*.c``); :func:`load` compiles it with the
system C compiler (``$CC``, else ``cc``; inductor needs one on the CPU too) at ``-O3
-march=native`` into a cache folder and opens it with ctypes, which releases the GIL for the
call. The library's name hashes the source, the flags, the compiler's version and the CPU's
model and flags, so an edited source or another machine sharing the folder builds its own; a
build takes about half a second. Processes that build at once each write a temporary file and
rename it into place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-Wall")
BUILD_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The kernel could not be compiled or opened here; the message says why."""


def cache_dir() -> Path:
    """``$FERRY_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/ferry/native`` (``~/.cache`` by default)."""
    if os.environ.get("FERRY_NATIVE_CACHE"):
        return Path(os.environ["FERRY_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ferry" / "native"


@functools.cache
def load(source: Path) -> ctypes.CDLL:
    """The compiled ``source`` (built now unless cached). Raises :class:`BuildError`."""
    cc = _compiler()
    key = hashlib.sha256(
        b"\0".join((source.read_bytes(), " ".join(FLAGS).encode(), _version(cc), _cpu()))
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        _build(cc, source, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise BuildError(f"cannot open {target}: {exc}") from exc


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise BuildError(f"no C compiler {cc!r} on PATH (set CC, or install gcc)")
    return path


def _version(cc: str) -> bytes:
    run = subprocess.run([cc, "--version"], capture_output=True, timeout=BUILD_TIMEOUT_S)
    return run.stdout


def _cpu() -> bytes:
    """The CPU's model and feature flags, as -march=native sees them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine.encode()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep)).encode()


def _build(cc: str, source: Path, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        raise BuildError(
            f"cannot write to {target.parent} (set FERRY_NATIVE_CACHE): {exc}"
        ) from exc
    os.close(fd)
    try:
        run = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if run.returncode != 0:
            raise BuildError(f"{cc} could not build {source.name}:\n{run.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
