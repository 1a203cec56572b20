"""AgentX-like agentic coding sessions: a seeded synthetic workload, and its trace files.

A session is what one coding agent sends while it works on one task. Its requests form a tree:
each request's context is its parent's context, the parent's reply, then what it appends.

- Every session starts with the same system prompt (shared by all sessions, like an agent's
  instructions and tool schemas), then a first user turn that begins with a cache-busting marker
  (``[session <hex>]``), so that sessions share the system prompt's KV blocks and nothing more.
- Each turn appends the assistant's reply and then tool output (``tool_probability``) or user
  text. Contexts grow every turn until the next request would not fit in
  ``max_context_tokens`` (prompt + its output): then the agent stops, as an agent that runs out
  of context does. The defaults start at ~720 tokens and grow a context by ~440 a main turn,
  so a session runs ~8 main turns (~10 requests with its subagents' ones) and its largest
  request reaches 2,900-4,096 tokens (3,860 on average over 200 sessions).
- From its second turn on, a main turn may fork a subagent (``subagent_probability``): the
  subagent's first request is the parent's context plus a subtask, it runs a few turns of its
  own, then returns: the parent's next request appends its result as a tool message. The
  parent waits for it (as a tool call does), so one session is one request in flight at a time
  and a run's concurrency is its number of live sessions.
- Before every request but a session's first the agent thinks (tool runs, the user reads):
  ``think_time_s``.
- The replies in the contexts are the trace's own text, not what the model generated (as
  AgentX replays recorded sessions with ``ignore_eos``): every configuration sees the same
  prompts. Each request asks for exactly its output length (``ignore_eos``, greedy).

Lengths are in tokens of the byte-level presets (one token per UTF-8 byte; the text is ASCII)
with the gateway's default chat template (:func:`prompt_tokens` counts exactly what the gateway
will tokenize). The tiny and small presets' limit is ``max_position_embeddings`` = 4096, which is
also the engines' ``max_model_len`` when none is given; for another model pass its limit.

Distributions (per request unless said; ``LogNormal(median, sigma)`` clipped to [low, high]):

==========================  ==========================================  =========
what                        distribution                                mean
==========================  ==========================================  =========
system prompt               fixed, ``system_prompt_tokens`` (512)
first user turn             uniform 64..256 tokens, after the marker    160
output per request          LogNormal(64, 0.5) in [16, 256]              ~72
tool output                 LogNormal(320, 0.6) in [32, 1024]            ~370
user text                   LogNormal(48, 0.6) in [8, 256]               ~55
subagent fork               p = 0.15 per main turn (from the second)
subagent turns              uniform 2..4
subagent result             uniform 64..192 tokens                       128
think time                  exponential, mean 0.5 s, at most 3 s         ~0.5 s
==========================  ==========================================  =========

A trace file is JSON lines: a header ``{"agentx": 1, "config": {...}}``, then one line per
request (see :class:`Request`), sessions in order. ``write_trace`` / ``read_trace``, or

    python loadtest/write_trace.py --sessions 200 --out trace.jsonl   # then locust --agentx-trace
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ferry.gateway.chat_template import ChatTemplate

Message = dict[str, str]  # {"role": ..., "content": ...}
TRACE_VERSION = 1
_TEMPLATE = ChatTemplate()  # the gateway's default template (the presets have no other)
_VOCABULARY = (
    "def return self import class if else for in while None True False value result error "
    "test path file line data index count items config request response client server cache "
    "block token model worker queue stream event assert raise except try with open read write "
    "json dict list str int float len range print update append get set key name args"
)
_WORDS = _VOCABULARY.split()  # the synthetic text's words


@dataclass(frozen=True)
class LogNormal:
    """Integers from a log-normal distribution with this median, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.low, min(self.high, round(value)))


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that decides the sessions; the same config and seed give the same sessions."""

    seed: int = 0
    max_context_tokens: int = 4096  # prompt + output of a request (the model's max_model_len)
    system_prompt_tokens: int = 512
    first_user_tokens: tuple[int, int] = (64, 256)
    output_tokens: LogNormal = LogNormal(64, 0.5, 16, 256)
    tool_output_tokens: LogNormal = LogNormal(320, 0.6, 32, 1024)
    user_text_tokens: LogNormal = LogNormal(48, 0.6, 8, 256)
    tool_probability: float = 0.8  # a turn appends tool output, else user text
    subagent_probability: float = 0.15
    subagent_turns: tuple[int, int] = (2, 4)
    subagent_result_tokens: tuple[int, int] = (64, 192)
    think_time_s: float = 0.5  # mean of the exponential
    max_think_time_s: float = 3.0
    max_turns: int = 64  # per agent; the context limit ends sessions long before

    def __post_init__(self) -> None:
        if self.max_context_tokens < self.system_prompt_tokens + 2 * self.first_user_tokens[1]:
            raise ValueError("max_context_tokens leaves no room after the system prompt")
        for name in ("tool_probability", "subagent_probability"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.think_time_s < 0 or self.max_think_time_s < 0:
            raise ValueError("think times must be >= 0")

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> WorkloadConfig:
        kw = dict(raw)
        for name in ("output_tokens", "tool_output_tokens", "user_text_tokens"):
            if isinstance(kw.get(name), dict):
                kw[name] = LogNormal(**kw[name])  # type: ignore[arg-type]
        for name in ("first_user_tokens", "subagent_turns", "subagent_result_tokens"):
            if isinstance(kw.get(name), list):
                kw[name] = tuple(kw[name])  # type: ignore[arg-type]
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Request:
    """One chat completion of a session. Its context is the parent's context, the parent's
    ``reply`` as an assistant message, then ``append`` (the first request: just ``append``)."""

    id: str  # "s000003/main/02", "s000003/sub1/00"
    session: int
    agent: str  # "main", "sub1", "sub2", ...
    parent: str | None
    append: tuple[Message, ...]
    reply: str  # the assistant text later requests see after this one (not the live output)
    max_tokens: int
    think_s: float  # the agent waits this long before sending it
    prompt_tokens: int  # of the rendered context (byte-level presets)

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["append"] = list(self.append)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> Request:
        kw = dict(raw)
        kw["append"] = tuple(kw["append"])  # type: ignore[arg-type]
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Session:
    index: int
    requests: tuple[Request, ...]  # in the order the agent sends them

    def play(self) -> Iterator[tuple[Request, list[Message]]]:
        """Each request with its full context (the messages to send)."""
        contexts: dict[str, list[Message]] = {}
        by_id = {r.id: r for r in self.requests}
        for r in self.requests:
            messages = list(r.append)
            if r.parent is not None:
                parent = by_id[r.parent]
                messages = [*contexts[r.parent], assistant(parent.reply), *r.append]
            contexts[r.id] = messages
            yield r, messages


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def render_prompt(messages: list[Message]) -> str:
    """The prompt text the gateway makes of ``messages`` (its default chat template)."""
    return _TEMPLATE.render(messages, add_generation_prompt=True)


def prompt_tokens(messages: list[Message]) -> int:
    """Tokens of the rendered prompt for the byte-level presets: its UTF-8 bytes plus BOS."""
    return len(render_prompt(messages).encode()) + 1


def system_prompt(config: WorkloadConfig) -> str:
    """The system prompt every session shares (it depends on the seed only)."""
    return _text(random.Random(f"agentx-system:{config.seed}"), config.system_prompt_tokens)


def _text(rng: random.Random, n: int) -> str:
    """ASCII code-like text of exactly ``n`` bytes."""
    parts: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(_WORDS)
        sep = "\n" if rng.random() < 0.12 else " "
        parts.append(word + sep)
        size += len(word) + 1
    return "".join(parts)[:n]


def _tool(call_id: str, output: str) -> Message:
    """A tool turn: what the call ``call_id`` returned (OpenAI requires the id)."""
    return {"role": "tool", "tool_call_id": call_id, "content": output}


@dataclass
class _SessionBuilder:
    """Grows one session's request tree, turn by turn, within the context limit."""

    config: WorkloadConfig
    index: int
    rng: random.Random = field(init=False)
    requests: list[Request] = field(default_factory=list)
    contexts: dict[str, list[Message]] = field(default_factory=dict)
    subagents: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(f"agentx:{self.config.seed}:{self.index}")

    def build(self) -> Session:
        c = self.config
        marker = f"[session {self.rng.getrandbits(64):016x}] "
        task = marker + _text(self.rng, self.rng.randint(*c.first_user_tokens))
        first = ({"role": "system", "content": system_prompt(c)}, {"role": "user", "content": task})
        self._agent("main", None, first, c.max_turns)
        return Session(self.index, tuple(self.requests))

    def _agent(
        self, agent: str, parent: Request | None, append: tuple[Message, ...], turns: int
    ) -> None:
        """Up to ``turns`` requests of one agent, the first appending ``append`` to ``parent``'s
        context; ends early when the next request would not fit."""
        for turn in range(turns):
            req = self._add(agent, turn, parent, append)
            if req is None:
                return
            parent = req
            append = self._subagent(req) if self._forks(agent, turn) else (self._observation(),)

    def _forks(self, agent: str, turn: int) -> bool:
        """Whether this main turn starts a subagent (never the first turn, never a subagent)."""
        return (
            agent == "main" and turn >= 1 and self.rng.random() < self.config.subagent_probability
        )

    def _subagent(self, fork: Request) -> tuple[Message, ...]:
        """Run a subagent forked from ``fork``; returns what the parent appends next."""
        c = self.config
        self.subagents += 1
        name = f"sub{self.subagents}"
        subtask = {"role": "user", "content": "Subtask: " + _text(self.rng, 96)}
        self._agent(name, fork, (subtask,), self.rng.randint(*c.subagent_turns))
        result = _text(self.rng, self.rng.randint(*c.subagent_result_tokens))
        return (_tool(f"call_{name}", f"{name} returned: {result}"),)

    def _observation(self) -> Message:
        c = self.config
        if self.rng.random() < c.tool_probability:
            output = _text(self.rng, c.tool_output_tokens.sample(self.rng))
            return _tool(f"call_{len(self.requests)}", output)
        return {"role": "user", "content": _text(self.rng, c.user_text_tokens.sample(self.rng))}

    def _add(
        self, agent: str, turn: int, parent: Request | None, append: tuple[Message, ...]
    ) -> Request | None:
        """The next request, or None when it would not fit in the context limit."""
        c = self.config
        messages = list(append)
        if parent is not None:
            messages = [*self.contexts[parent.id], assistant(parent.reply), *append]
        n_out = c.output_tokens.sample(self.rng)
        n_prompt = prompt_tokens(messages)
        if n_prompt + n_out > c.max_context_tokens:
            return None
        think = 0.0 if parent is None else self._think()
        req = Request(
            f"s{self.index:06d}/{agent}/{turn:02d}",
            self.index,
            agent,
            parent.id if parent else None,
            append,
            _text(self.rng, n_out),
            n_out,
            think,
            n_prompt,
        )
        self.requests.append(req)
        self.contexts[req.id] = messages
        return req

    def _think(self) -> float:
        c = self.config
        if c.think_time_s == 0:
            return 0.0
        return round(min(c.max_think_time_s, self.rng.expovariate(1 / c.think_time_s)), 3)


def generate_session(config: WorkloadConfig, index: int) -> Session:
    """Session ``index`` of the workload: a pure function of (config, index)."""
    return _SessionBuilder(config, index).build()


def generate_sessions(config: WorkloadConfig, start: int, stop: int) -> list[Session]:
    return [generate_session(config, i) for i in range(start, stop)]


def write_trace(path: str | Path, config: WorkloadConfig, sessions: Iterable[Session]) -> int:
    """Write the sessions as a JSON-lines trace; returns the number of requests written."""
    n = 0
    with open(path, "w") as f:
        f.write(json.dumps({"agentx": TRACE_VERSION, "config": config.to_dict()}) + "\n")
        for s in sessions:
            for r in s.requests:
                f.write(json.dumps(r.to_dict()) + "\n")
                n += 1
    return n


def read_trace(path: str | Path) -> tuple[WorkloadConfig, list[Session]]:
    """The config and sessions of a trace written by :func:`write_trace`."""
    with open(path) as f:
        header = json.loads(f.readline())
        if header.get("agentx") != TRACE_VERSION:
            raise ValueError(f"{path}: not an AgentX trace (version {TRACE_VERSION})")
        config = WorkloadConfig.from_dict(header["config"])
        by_session: dict[int, list[Request]] = {}
        for line in f:
            if line.strip():
                r = Request.from_dict(json.loads(line))
                by_session.setdefault(r.session, []).append(r)
    return config, [Session(i, tuple(rs)) for i, rs in sorted(by_session.items())]


def summary(sessions: list[Session]) -> dict[str, float]:
    """Shape of a workload: requests, subagent share, context and output sizes."""
    reqs = [r for s in sessions for r in s.requests]
    if not reqs:
        return {"sessions": len(sessions), "requests": 0}
    prompts = sorted(r.prompt_tokens for r in reqs)
    return {
        "sessions": len(sessions),
        "requests": len(reqs),
        "requests_per_session": len(reqs) / len(sessions),
        "subagent_request_share": sum(r.agent != "main" for r in reqs) / len(reqs),
        "prompt_tokens_mean": sum(prompts) / len(prompts),
        "prompt_tokens_max": prompts[-1],
        "context_tokens_max": max(r.prompt_tokens + r.max_tokens for r in reqs),
        "output_tokens_mean": sum(r.max_tokens for r in reqs) / len(reqs),
    }
