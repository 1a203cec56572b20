"""The examples in README.md, docs/*.md and loadtest/README.md run as written, from any directory.

Every fenced block says its language. A ``bash`` / ``sh`` / ``shell`` or ``python`` block runs,
in the order of its file, from a directory outside the checkout (one per file, so that a block
can use what an earlier one wrote), with the venv's ``bin`` first on ``PATH`` and no
``PYTHONPATH``; it must exit 0. loadtest/README.md's commands run from the checkout's root, so
its directory has a ``loadtest`` link to the checkout's (its scripts' outputs land beside it, not
in the checkout). The blocks run against one ``ferry up`` of the tiny model on free ports: the
default addresses in the text are rewritten to that cluster's (``rewrites``). ``text`` blocks
(output listings, diagrams) are not run.

The examples run in ``make test-slow``; that every fence says its language and every marker a
known reason is checked in ``make test``.

A block that cannot run here says why in the line directly above its fence::

    <!-- example: starts a cluster -->

with one of the ``REASONS`` below. It is skipped with that reason, but its ``ferry`` command
lines are still parsed by the CLI and its Python imports still run, so that a renamed flag or
module fails here, not for a reader.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import Cluster, ferry_up

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "loadtest" / "README.md"]
FROM_THE_ROOT = {ROOT / "loadtest" / "README.md"}  # its commands name loadtest/ scripts

RUN = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
NOT_RUN = {"text"}
REASONS = {
    "starts a cluster": "it starts a cluster of its own (the test provides one)",
    "needs root": "it needs root (network namespaces, sudo)",
    "needs a gpu": "it needs a CUDA GPU",
    "needs docker": "it needs docker and a base image",
    "needs kubernetes": "it needs a Kubernetes cluster",
    "needs a DEP group": "it needs a cluster with a DEP group (its EPLB controller)",
    "long": "it runs for minutes (a benchmark, a sweep, the test suite)",
    "writes loadtest/results": "it rewrites the checked-in results",
}
MARKER = re.compile(r"^\s*<!-- example: (.+?) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    reason: str  # the marker's, or ""

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def parse(doc: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``doc``, and what is wrong with its fences and markers."""
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        marker = MARKER.match(lines[i])
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            problems.append(f"{doc.name}:{i + 1}: a marker not directly above a fence")
        if not opened:
            i += 1
            continue
        indent, lang = opened.groups()
        end = next((j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])), None)
        if end is None:
            problems.append(f"{doc.name}:{i + 1}: a fence that is never closed")
            break
        above = MARKER.match(lines[i - 1]) if i else None
        reason = above.group(1) if above else ""
        where = f"{doc.name}:{i + 1}"
        if not lang:
            problems.append(f"{where}: a fence without a language (bash, python, text, ...)")
        elif lang not in RUN and lang not in NOT_RUN:
            problems.append(f"{where}: language {lang!r} is neither run nor a listing")
        if reason and reason not in REASONS:
            problems.append(f"{where}: unknown reason {reason!r} (one of {sorted(REASONS)})")
        if reason and lang in NOT_RUN:
            problems.append(f"{where}: a marker on a {lang} block, which is never run")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
        blocks.append(Block(doc, i + 1, lang, "\n".join(body) + "\n", reason))
        i = end + 1
    return blocks, problems


def runnable() -> list[Block]:
    return [b for doc in DOCS for b in parse(doc)[0] if b.lang in RUN]


def test_every_fence_says_its_language_and_every_marker_a_known_reason() -> None:
    problems = [p for doc in DOCS for p in parse(doc)[1]]
    assert not problems, "\n".join(problems)
    assert runnable(), "no example found: is the parser still reading the files?"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # cluster "default": what `ferry status` reads unless told otherwise; one aggregated worker
    # serves every example and starts sooner than a prefill and a decode worker side by side
    with ferry_up("", "--aggregated", "1", cluster="default") as c:
        yield c


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """A directory outside the checkout per file."""
    dirs = {}
    for doc in DOCS:
        d = tmp_path_factory.mktemp(doc.stem.lower())
        if doc in FROM_THE_ROOT:
            (d / "loadtest").symlink_to(ROOT / "loadtest")
        dirs[doc] = d
    return dirs


def rewrites(c: Cluster) -> dict[str, str]:
    """The docs' default addresses → the test cluster's."""
    return {
        "127.0.0.1:8000": c.gateway.removeprefix("http://"),
        "127.0.0.1:50051": c.grpc,
        "redis://127.0.0.1:PORT/0": c.redis_url,
    }


def uses_a_cluster(code: str) -> bool:
    return any(address in code for address in ("127.0.0.1:8000", "127.0.0.1:50051", ":PORT/"))


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    # one OpenMP thread: the cluster's workers share the cores, and torch's threads spinning at
    # their barriers beside them starve an in-process example
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def run(block: Block, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The block in a process group of its own, which is killed after it, whatever it left."""
    argv = [sys.executable, "-c", code] if RUN[block.lang] == "python" else ["bash", "-c", code]
    if argv[0] == "bash":
        argv[1:1] = ["-e", "-o", "pipefail"]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.id} did not finish within {TIMEOUT_S} s:\n{out}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone with its last process
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def ferry_commands(code: str) -> list[list[str]]:
    """The ``ferry ...`` command lines of a shell block (continuations joined, comments and
    ``sudo`` dropped), as argv after ``ferry``."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["sudo"]:
            words = words[1:]
        if words[:1] == ["ferry"]:
            commands.append(words[1:])
    return commands


def check_without_running(block: Block, cwd: Path) -> None:
    """What a skipped block can still be held to: its flags parse, its imports import."""
    if RUN[block.lang] == "bash":
        from ferry.infra.cli import build_parser

        for argv in ferry_commands(block.code):
            try:
                build_parser().parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{block.id}: `ferry {shlex.join(argv)}` does not parse (exit {e})")
        return
    tree = ast.parse(block.code)
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    done = run(block, "\n".join(ast.unparse(n) for n in imports), cwd)
    assert done.returncode == 0, f"{block.id}: its imports fail:\n{done.stdout}"


@pytest.mark.slow  # a cluster, and torch imported in several fresh processes
@pytest.mark.parametrize("block", runnable(), ids=lambda b: b.id)
def test_example_runs(
    block: Block, workdirs: dict[Path, Path], request: pytest.FixtureRequest
) -> None:
    cwd = workdirs[block.doc]
    if block.reason:
        check_without_running(block, cwd)
        pytest.skip(f"{block.reason}: {REASONS[block.reason]}")
    code = block.code
    if uses_a_cluster(code):
        c: Cluster = request.getfixturevalue("cluster")
        for default, address in rewrites(c).items():
            code = code.replace(default, address)
    done = run(block, code, cwd)
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{code}\n---\n{done.stdout}"
