"""Locust users that play AgentX-like agentic sessions (``agentx.py``) against a Ferry cluster.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 30s -s 120 \\
        --host http://127.0.0.1:8000 AgentChatUser

- ``AgentChatUser``: streaming chat completions through the OpenAI REST API
  (``POST /v1/chat/completions``, ``stream``, ``ignore_eos``, ``stream_options.include_usage``).
- ``AgentGrpcUser``: the same requests through the Python SDK (``FerryClient``, the gateway's
  public gRPC API), the chat template rendered here and sent as the prompt text.
- ``AgentCompletionsUser``: the same prompt text as streaming completions over the OpenAI REST
  API (``POST /v1/completions``), which any OpenAI-compatible server takes the same way
  (``bench_peer.py`` runs it against llama.cpp's ``llama-server`` and Ferry alike).

A Locust user is one agent: it plays one session's requests in order, waits each request's think
time before sending it, and starts the next session when one ends. ``-u`` is therefore the number
of live sessions, AgentX's concurrency. Give ``-s`` (stop timeout) so that the request in flight
when the run ends completes.

Per request the users fire Locust request events (the web UI and ``--csv`` show them), named by
the API (``chat`` or ``grpc``): ``TTFT`` (send to first token), ``TPOT`` ((end - first token) /
(output tokens - 1)), ``ITL`` (every gap between two streamed chunks) and ``E2E`` (send to last
token, with the output tokens as its length). A request fails (its E2E) when the stream ends
without a finish reason, carries an error, or the HTTP status is not 200.

Options: ``--agentx-trace FILE`` (replay a trace; default: generate from ``--agentx-seed``),
``--agentx-sessions START:STOP`` (which sessions this run plays), ``--agentx-max-context``,
``--agentx-log FILE`` (one JSON line per request, and a last ``{"summary": ...}`` line with the
requests started and finished: what ``levels.py`` computes a level's figures from),
``--agentx-grpc-host``, ``--agentx-model``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel exists: grpc's blocking calls yield to gevent

import requests  # noqa: E402
from agentx import (  # noqa: E402
    Message,
    Request,
    Session,
    WorkloadConfig,
    generate_session,
    read_trace,
    render_prompt,
)
from locust import User, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.exception import StopUser  # noqa: E402
from locust.runners import STATE_CLEANUP, STATE_STOPPED, STATE_STOPPING  # noqa: E402
from sse import sse_events  # noqa: E402

from ferry.gateway.sdk import FerryClient, FerryError  # noqa: E402

REQUEST_TIMEOUT_S = 300.0


@dataclass
class Measured:
    """One streamed request as the client saw it; times in seconds."""

    sent_at: float = field(default_factory=time.time)
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    _start: float = field(default_factory=time.perf_counter, repr=False)
    _last: float = field(default=0.0, repr=False)

    def arrived(self) -> None:
        """A chunk with tokens arrived now."""
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self._start
        else:
            self.itl.append(now - self._last)
        self._last = now

    def ended(self) -> Measured:
        self.e2e = time.perf_counter() - self._start
        return self

    @property
    def ok(self) -> bool:
        return not self.error and self.finish_reason is not None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def failure(self) -> str:
        return self.error or "the stream ended without a finish reason"


class SessionSource:
    """Hands out sessions ``start``, ``start + 1``, ... (before ``stop``) to the users in turn:
    from a trace, or generated from the config's seed."""

    def __init__(
        self, config: WorkloadConfig, start: int, stop: int | None, trace: list[Session] | None
    ) -> None:
        self.config = config
        self.next_index = start
        self.stop = stop
        self.trace = {s.index: s for s in trace} if trace is not None else None

    def next(self) -> Session | None:
        i = self.next_index
        if self.stop is not None and i >= self.stop:
            return None
        self.next_index += 1
        if self.trace is None:
            return generate_session(self.config, i)
        return self.trace.get(i)


class RequestLog:
    """One JSON line per finished request; a summary line at the end."""

    def __init__(self, path: str) -> None:
        self.file: IO[str] | None = open(path, "w") if path else None  # noqa: SIM115
        self.started = 0
        self.finished = 0

    def write(self, api: str, request: Request, m: Measured) -> None:
        self.finished += 1
        if self.file is None:
            return
        row = {
            "api": api,
            "id": request.id,
            "session": request.session,
            "agent": request.agent,
            "max_tokens": request.max_tokens,
            "expected_prompt_tokens": request.prompt_tokens,
            "sent_at": m.sent_at,
            "ttft": m.ttft,
            "tpot": m.tpot,
            "e2e": m.e2e,
            "itl": [round(x, 6) for x in m.itl],
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "completion_tokens": m.completion_tokens,
            "finish_reason": m.finish_reason,
            "ok": m.ok,
            "error": "" if m.ok else m.failure(),
        }
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.file is not None:
            summary = {"started": self.started, "finished": self.finished}
            self.file.write(json.dumps({"summary": summary}) + "\n")
            self.file.close()
            self.file = None


@dataclass
class Run:
    """What the users of one test run share."""

    source: SessionSource
    log: RequestLog
    grpc_host: str
    model: str


RUN: Run | None = None


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument("--agentx-trace", default="", help="replay this trace (JSON lines)")
    parser.add_argument("--agentx-seed", type=int, default=0, help="workload seed (no trace)")
    parser.add_argument("--agentx-sessions", default="0:", help="START:STOP sessions to play")
    parser.add_argument(
        "--agentx-max-context", type=int, default=4096, help="the model's max_model_len (no trace)"
    )
    parser.add_argument("--agentx-log", default="", help="write one JSON line per request")
    parser.add_argument(
        "--agentx-grpc-host",
        default="127.0.0.1:50051",
        help="the gateway's public gRPC API (AgentGrpcUser)",
    )
    parser.add_argument("--agentx-model", default="tiny", help="the served model name")


@events.test_start.add_listener
def _start_run(environment: Environment, **_: Any) -> None:
    global RUN
    opts = environment.parsed_options
    start, _, stop = opts.agentx_sessions.partition(":")
    trace = None
    if opts.agentx_trace:
        config, trace = read_trace(opts.agentx_trace)
    else:
        config = WorkloadConfig(seed=opts.agentx_seed, max_context_tokens=opts.agentx_max_context)
    source = SessionSource(config, int(start or 0), int(stop) if stop else None, trace)
    RUN = Run(source, RequestLog(opts.agentx_log), opts.agentx_grpc_host, opts.agentx_model)


@events.test_stop.add_listener
def _stop_run(**_: Any) -> None:
    if RUN is not None:
        RUN.log.close()


def _run() -> Run:
    assert RUN is not None, "the test has not started"
    return RUN


class _Agent(User):
    """Plays sessions, one request at a time; subclasses send a request and measure it."""

    abstract = True
    api = ""

    def on_start(self) -> None:
        self.pending: list[tuple[Request, list[Message]]] = []

    def wait_time(self) -> float:
        """The next request's think time (0 when a new session starts)."""
        return self.pending[0][0].think_s if self.pending else 0.0

    @task
    def turn(self) -> None:
        run = _run()
        if self.environment.runner.state in (STATE_STOPPING, STATE_CLEANUP, STATE_STOPPED):
            # NOTE: the run is ending. Locust kills a user it finds waiting, but the kill lands
            # later: a user whose think time was 0 may already be in its next task, and would
            # die mid-request. Start nothing new instead.
            raise StopUser()
        if not self.pending:
            session = run.source.next()
            if session is None:
                raise StopUser()  # every session of the range has been handed out
            self.pending = list(session.play())
        request, messages = self.pending.pop(0)
        run.log.started += 1
        m = self.send(request, messages).ended()
        run.log.write(self.api, request, m)
        self._fire(m)

    def send(self, request: Request, messages: list[Message]) -> Measured:
        raise NotImplementedError

    def _fire(self, m: Measured) -> None:
        def fire(kind: str, seconds: float, length: int = 0, error: str = "") -> None:
            self.environment.events.request.fire(
                request_type=kind,
                name=self.api,
                response_time=seconds * 1000,
                response_length=length,
                exception=RuntimeError(error) if error else None,
                context={},
            )

        if m.ttft is not None:
            fire("TTFT", m.ttft, m.prompt_tokens)
        if m.tpot is not None:
            fire("TPOT", m.tpot)
        for gap in m.itl:
            fire("ITL", gap)
        fire("E2E", m.e2e, m.completion_tokens, "" if m.ok else m.failure())


class AgentChatUser(_Agent):
    """Sessions as streaming chat completions over the OpenAI REST API."""

    api = "chat"

    def on_start(self) -> None:
        super().on_start()
        self.http = requests.Session()

    def on_stop(self) -> None:
        self.http.close()

    def send(self, request: Request, messages: list[Message]) -> Measured:
        return self.stream("/v1/chat/completions", {"messages": messages}, request, _on_chat_event)

    def stream(
        self,
        path: str,
        body: dict[str, Any],
        request: Request,
        on_event: Callable[[Measured, dict[str, Any]], None],
    ) -> Measured:
        """POST ``body`` (greedy, ``ignore_eos``, streamed with usage) and measure its stream."""
        body = {
            "model": _run().model,
            **body,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        m = Measured()
        try:
            with self.http.post(
                f"{self.host}{path}", json=body, stream=True, timeout=(10, REQUEST_TIMEOUT_S)
            ) as resp:
                if resp.status_code != 200:
                    m.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                    return m
                for event in sse_events(resp):
                    on_event(m, event)
        except requests.RequestException as e:
            m.error = f"{type(e).__name__}: {e}"
        return m


class AgentCompletionsUser(AgentChatUser):
    """Sessions as streaming text completions: the chat template rendered here, as for gRPC."""

    api = "completions"

    def send(self, request: Request, messages: list[Message]) -> Measured:
        prompt = {"prompt": render_prompt(messages)}
        return self.stream("/v1/completions", prompt, request, _on_completion_event)


def _on_completion_event(m: Measured, event: dict[str, Any]) -> None:
    if not _error_or_usage(m, event):
        return
    for choice in event.get("choices", []):
        if choice.get("text") or choice.get("finish_reason") is None:
            m.arrived()  # a token (llama-server also sends the finish reason on its own)
        m.finish_reason = choice.get("finish_reason") or m.finish_reason


def _error_or_usage(m: Measured, event: dict[str, Any]) -> bool:
    """Take an event's error or usage into ``m``; False when it carries an error."""
    if "error" in event:
        m.error = str(event["error"].get("message", event["error"]))
        return False
    if usage := event.get("usage"):
        m.prompt_tokens = usage["prompt_tokens"]
        m.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        m.cached_tokens = details.get("cached_tokens", 0)
    return True


def _on_chat_event(m: Measured, event: dict[str, Any]) -> None:
    if not _error_or_usage(m, event):
        return
    for choice in event.get("choices", []):
        if "role" in choice.get("delta", {}):
            continue  # the opening event: it comes before any token
        m.arrived()  # every later chunk event carries tokens (its text may still be empty)
        m.finish_reason = choice.get("finish_reason") or m.finish_reason


class AgentGrpcUser(_Agent):
    """Sessions through the Python SDK (the gateway's public gRPC API, ``ferry.v1.Ferry``)."""

    api = "grpc"

    def on_start(self) -> None:
        super().on_start()
        self.client = FerryClient(_run().grpc_host, timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def on_stop(self) -> None:
        self.client.close()

    def send(self, request: Request, messages: list[Message]) -> Measured:
        m = Measured()
        try:
            for chunk in self.client.generate(
                render_prompt(messages),
                model=_run().model,
                max_tokens=request.max_tokens,
                temperature=0,
                ignore_eos=True,
            ):
                if chunk.token_ids:
                    m.arrived()
                m.completion_tokens += len(chunk.token_ids)
                if chunk.usage is not None:
                    m.prompt_tokens = chunk.usage.prompt_tokens
                    m.cached_tokens = chunk.usage.cached_tokens
                m.finish_reason = chunk.finish_reason or m.finish_reason
        except FerryError as e:
            m.error = str(e)
        return m
