"""What the simulated clients send: AgentX-like agent sessions (loadtest/agentx.py, the
generator the benchmarks use) or a JSON-lines trace.

A session is a list of requests sent one after another: each waits for the previous one to
finish, then ``think_s`` (closed loop, as an agent works); a trace request with ``arrival_s``
is instead sent at that time (open loop). Prompt token ids are what the prefix cache hashes: an
AgentX request's are the bytes of its rendered context (its turns extend its parent's, and
every session shares the system prompt), so prefix hits come out of the KV cache manager.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

AGENTX_PATH = Path(__file__).resolve().parents[2] / "loadtest" / "agentx.py"
BOS = 256  # the byte-level vocabulary's BOS (ids 0-255 are bytes)


@dataclass(frozen=True)
class SimRequest:
    session: int
    prompt: Callable[[], list[int]]  # built when sent: long contexts are not all kept
    prompt_len: int
    max_tokens: int
    think_s: float = 0.0  # closed loop: the wait after the previous request of the session
    arrival_s: float | None = None  # open loop: when it is sent


class Workload:
    """Sessions by index; ``open_loop`` workloads give every request an ``arrival_s``."""

    name = ""
    open_loop = False

    def session(self, index: int) -> list[SimRequest]:
        raise NotImplementedError

    @property
    def num_sessions(self) -> int | None:
        """None: unbounded (generated)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def prepare(self, num_sessions: int) -> None:
        """Build the first sessions now (before the sweep forks its workers, which share them)."""
        for i in range(min(num_sessions, self.num_sessions or num_sessions)):
            self.session(i)


@cache
def agentx_module() -> ModuleType:
    """loadtest/agentx.py, loaded from the repository (the load-test scripts are not part of
    the installed package)."""
    if not AGENTX_PATH.is_file():
        raise ValueError(f"the AgentX generator is not at {AGENTX_PATH} (run from a checkout)")
    spec = importlib.util.spec_from_file_location("agentx", AGENTX_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("agentx", module)
    spec.loader.exec_module(module)
    # this copy's only: the load tests keep theirs
    module.__dict__["_text"] = _filler(module.__dict__["_text"])
    return module


def _filler(text: Callable[[random.Random, int], str]) -> Callable[[random.Random, int], str]:
    """The generator's filler text, as slices of one text it made: the same lengths and
    structure, for a fraction of the time (word by word, it costs more than simulating)."""
    corpus = text(random.Random("agentx-simulator"), 1 << 18)

    def sliced(rng: random.Random, n: int) -> str:
        start = rng.randrange(len(corpus))
        return (corpus * (n // len(corpus) + 2))[start : start + n]

    return sliced


class AgentX(Workload):
    """loadtest/agentx.py's sessions, every length ``scale`` times the generator's defaults
    (which are sized for the 4,096-token presets); think times unchanged."""

    name = "agentx"

    def __init__(self, scale: int = 1, seed: int = 0, config: Any = None) -> None:
        ax = agentx_module()
        self.scale = scale
        self.config = config or _scaled_config(ax, scale, seed)
        self._built: dict[int, list[SimRequest]] = {}  # generating text costs more than simulating

    def session(self, index: int) -> list[SimRequest]:
        if index not in self._built:
            self._built[index] = self._build(index)
        return self._built[index]

    def _build(self, index: int) -> list[SimRequest]:
        ax = agentx_module()
        out = []
        for r, messages in ax.generate_session(self.config, index).play():
            out.append(
                SimRequest(
                    session=index,
                    prompt=_rendered(ax, messages),
                    prompt_len=r.prompt_tokens,
                    max_tokens=r.max_tokens,
                    think_s=r.think_s,
                )
            )
        return out

    def describe(self) -> dict[str, Any]:
        ax = agentx_module()
        sample = ax.generate_sessions(self.config, 0, 20)
        return {"name": self.name, "scale": self.scale, "config": self.config.to_dict()} | {
            "sample_summary": ax.summary(sample)
        }


def _rendered(ax: ModuleType, messages: list[dict[str, str]]) -> Callable[[], list[int]]:
    return lambda: [BOS, *ax.render_prompt(messages).encode()]


def _scaled_config(ax: ModuleType, scale: int, seed: int) -> Any:
    c = ax.WorkloadConfig(seed=seed)
    if scale == 1:
        return c

    def grow(d: Any) -> Any:
        return ax.LogNormal(d.median * scale, d.sigma, d.low * scale, d.high * scale)

    return ax.WorkloadConfig(
        seed=seed,
        max_context_tokens=c.max_context_tokens * scale,
        system_prompt_tokens=c.system_prompt_tokens * scale,
        first_user_tokens=(c.first_user_tokens[0] * scale, c.first_user_tokens[1] * scale),
        output_tokens=grow(c.output_tokens),
        tool_output_tokens=grow(c.tool_output_tokens),
        user_text_tokens=grow(c.user_text_tokens),
        subagent_result_tokens=(
            c.subagent_result_tokens[0] * scale,
            c.subagent_result_tokens[1] * scale,
        ),
    )


class Trace(Workload):
    """A JSON-lines trace: one request a line with ``session``, ``output_len`` (or
    ``max_tokens``), ``prompt_tokens`` (a list of ids) or ``prompt_len``, and optionally
    ``arrival_s`` (then it is replayed open loop at those times, divided by the load) or
    ``think_s``. A prompt given by length only is the first tokens of a stream of ids seeded
    by its session, so a session's later turns extend its earlier ones. An AgentX trace
    (loadtest/write_trace.py) is read as that generator's sessions instead."""

    name = "trace"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        by_session: dict[int, list[SimRequest]] = {}
        with open(self.path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    req = _trace_request(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.path}:{n}: {exc}") from exc
                by_session.setdefault(req.session, []).append(req)
        if not by_session:
            raise ValueError(f"{self.path}: no requests")
        self.sessions = [by_session[k] for k in sorted(by_session)]
        self.open_loop = all(r.arrival_s is not None for s in self.sessions for r in s)

    def session(self, index: int) -> list[SimRequest]:
        return self.sessions[index]

    @property
    def num_sessions(self) -> int | None:
        return len(self.sessions)

    def describe(self) -> dict[str, Any]:
        reqs = [r for s in self.sessions for r in s]
        return {
            "name": self.name,
            "path": str(self.path),
            "sessions": len(self.sessions),
            "requests": len(reqs),
            "open_loop": self.open_loop,
        }


def _trace_request(raw: dict[str, Any]) -> SimRequest:
    session = int(raw["session"])
    out = int(raw.get("output_len", raw.get("max_tokens", 0)))
    if out < 1:
        raise ValueError("output_len must be >= 1")
    arrival = raw.get("arrival_s")
    if "prompt_tokens" in raw and isinstance(raw["prompt_tokens"], list):
        ids = [int(t) for t in raw["prompt_tokens"]]
        return SimRequest(
            session, lambda: ids, len(ids), out, float(raw.get("think_s", 0)), arrival
        )
    length = int(raw["prompt_len"] if "prompt_len" in raw else raw["prompt_tokens"])
    if length < 1:
        raise ValueError("prompt_len must be >= 1")
    return SimRequest(
        session,
        lambda: _session_stream(session, length),
        length,
        out,
        float(raw.get("think_s", 0)),
        None if arrival is None else float(arrival),
    )


def _session_stream(session: int, length: int) -> list[int]:
    rng = random.Random(f"trace-session:{session}")
    return [rng.randrange(256) for _ in range(length)]


def load_workload(trace: str | None, scale: int, seed: int) -> Workload:
    if not trace:
        return AgentX(scale, seed)
    with open(trace) as f:
        first = f.readline()
    try:
        header = json.loads(first)
    except ValueError as exc:
        raise ValueError(f"{trace}: not JSON lines ({exc})") from exc
    if isinstance(header, dict) and "agentx" in header:
        ax = agentx_module()
        config, sessions = ax.read_trace(trace)
        return _AgentXTrace(config, sessions)
    return Trace(trace)


class _AgentXTrace(AgentX):
    """An AgentX trace file: its own sessions, in order (then it starts over)."""

    def __init__(self, config: Any, sessions: list[Any]) -> None:
        super().__init__(config=config)
        self._sessions = sessions

    def _build(self, index: int) -> list[SimRequest]:
        ax = agentx_module()
        s = self._sessions[index % len(self._sessions)]
        return [
            SimRequest(index, _rendered(ax, m), r.prompt_tokens, r.max_tokens, r.think_s)
            for r, m in s.play()
        ]
