"""llama.cpp as a peer: its ``llama-server`` built from source, and a Ferry preset as a GGUF.

The source is the llama.cpp tree that the ``llama-cpp-python`` sdist on PyPI vendors (the only
copy this machine can download). Everything lives under ``build/peer`` (ignored by git), and
each step is skipped when its output is already there:

- ``build_server``: ``cmake`` Release, ``-DGGML_NATIVE=ON``, no web UI, target ``llama-server``
  (~10 minutes on 2 cores, once).
- ``convert``: ``ferry export-preset`` then llama.cpp's ``convert_hf_to_gguf.py`` to an f32
  GGUF. Two facts of the byte-level tokenizer need handling: the converter knows tokenizers by a
  hash of how they split a test string and refuses an unknown one (Ferry's splits into bytes:
  llama.cpp's "default" pre-tokenizer, whatever it splits, ends in the same bytes with no
  merges), and llama.cpp refuses a BPE vocabulary with no merges (``merges.txt`` gets one,
  of the bytes 0x00 0x01, which no text here contains). The exported config keeps
  ``scoring_func: sigmoid`` and ``topk_method: noaux_tc``; without them the converter would
  write softmax gating.
- ``LlamaServer``: ``llama-server`` started on a free port and stopped with its process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from ferry.infra.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "peer"
SDIST = "llama-cpp-python==0.3.36"
# the converter under our interpreter, with two of its tokenizer checks answered for Ferry's
# byte-level vocabulary (see the module docstring)
CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py", *sys.argv[2:]]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def say(msg: str) -> None:
    print(f"bench-peer: {msg}", file=sys.stderr, flush=True)


def source(cache: Path = CACHE) -> Path:
    """llama.cpp's tree from the llama-cpp-python sdist (downloaded once)."""
    tree = next(cache.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if tree is not None:
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    say(f"downloading the {SDIST} sdist (it vendors llama.cpp)")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(cache),
            SDIST,
        ],
        check=True,
    )
    sdist = next(cache.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(cache, filter="data")
    return next(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build_server(cache: Path = CACHE) -> Path:
    """The ``llama-server`` binary, built once (~10 minutes on 2 cores)."""
    build = cache / "server-build"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    tree = source(cache)
    say("building llama-server (Release, GGML_NATIVE; ~10 minutes on 2 cores)")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_UI=OFF"]
    flags += ["-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    log = cache / "build.log"
    with open(log, "w") as out:
        subprocess.run(
            ["cmake", "-S", str(tree), "-B", str(build), *flags], stdout=out, stderr=out, check=True
        )
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
            stdout=out,
            stderr=out,
            check=True,
        )
    return binary


def convert(preset: str, cache: Path = CACHE) -> tuple[Path, Path]:
    """(Ferry's checkpoint of ``preset``, its f32 GGUF), made once."""
    ckpt = cache / f"{preset}-hf"
    gguf = cache / f"{preset}-f32.gguf"
    if gguf.exists() and ckpt.exists():
        return ckpt, gguf
    shutil.rmtree(ckpt, ignore_errors=True)
    ferry = Path(sys.executable).with_name("ferry")
    subprocess.run([str(ferry), "export-preset", preset, str(ckpt)], check=True)
    (ckpt / "merges.txt").write_text("#version: 0.2\n\u0100 \u0101\n")  # bytes 0x00 0x01
    say(f"converting {preset} to GGUF (f32)")
    subprocess.run(
        [
            sys.executable,
            "-c",
            CONVERT,
            str(source(cache)),
            str(ckpt),
            "--outfile",
            str(gguf),
            "--outtype",
            "f32",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return ckpt, gguf


@contextmanager
def llama_server(
    binary: Path, gguf: Path, threads: int, slots: int, context: int, log: Path
) -> Iterator[str]:
    """``llama-server`` on a free loopback port, ``slots`` parallel sequences of ``context``
    tokens each, flash attention off (its CPU path drifts ~1e-3 from the reference); yields
    its base URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-np", str(slots)]
    cmd += ["-c", str(slots * context), "-fa", "off", "--no-webui"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: see {log}")
            try:
                if requests.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy in 120 s: see {log}")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
