"""schemathesis over the gateway's own OpenAPI schema: cases that keep to it (positive) and cases
that break it (negative: wrong types, out-of-range values, bodies that are not JSON) against
every route of a real cluster. No answer is a 5xx, every 4xx is OpenAI's error object, every
2xx reads (JSON, or server-sent events of JSON)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import requests
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.cluster import Cluster
from tests.fuzz.support import Tally, budget
from tests.helpers import TINY_HF

# cases per route; a route without parameters has one case to send (hypothesis stops there)
BUDGET = {
    ("GET", "/health"): 5,
    ("GET", "/metrics"): 5,
    ("GET", "/v1/models"): 5,
    ("GET", "/v1/models/{name}"): 100,
    ("POST", "/v1/completions"): 600,
    ("POST", "/v1/chat/completions"): 600,
    ("POST", "/tokenize"): 200,
    ("POST", "/detokenize"): 150,
}
# what a case that keeps to the schema may cost: the tiny model decodes on this CPU
MAX_TOKENS, MAX_N, MAX_PROMPTS = 4, 2, 3
SCHEMA_CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def schema(cluster: Cluster) -> schemathesis.BaseSchema:
    # every event of a stream read (schemathesis stops at 20), and a request sent once: a
    # connection the gateway dropped is a failure, not something to retry
    config = schemathesis.Config.from_dict({"max-stream-events": 10_000, "request-retries": 0})
    return schemathesis.openapi.from_url(cluster.gateway + "/openapi.json", config=config)


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def test_the_schema_has_every_route_and_its_bodies(schema: schemathesis.BaseSchema) -> None:
    """The fuzz covers the API (a route added to the gateway needs a budget here), and each
    POST route's body is in the schema, so that cases are made from it."""
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results), "operations schemathesis cannot read"
    assert {(op.method.upper(), op.path) for op in operations} == set(BUDGET)
    for op in operations:
        assert (op.method == "post") == bool(op.body), op.path


@pytest.mark.parametrize(("method", "path"), list(BUDGET), ids=[" ".join(k) for k in BUDGET])
def test_no_5xx_and_every_error_in_openai_shape(
    schema: schemathesis.BaseSchema,
    cluster: Cluster,
    checkpoint: Path,
    session: requests.Session,
    tallies: dict[str, Tally],
    method: str,
    path: str,
) -> None:
    op = schema[path][method]
    model = str(checkpoint)  # the served model's name
    tally, route = tallies["rest"], f"{method} {path}"

    @given(case=_cases(op, model))
    @budget(BUDGET[(method, path)])
    def one(case: Case) -> None:
        response = case.call(base_url=cluster.gateway, session=session, timeout=60)
        streamed = isinstance(case.body, dict) and case.body.get("stream") is True
        tally.count(route, f"{response.status_code}{' stream' if streamed else ''}")
        kind = (response.headers.get("content-type") or [""])[0]
        problem = _problem(response.status_code, kind, response.text)
        problem = problem or _undocumented(case, response)
        if problem is not None:
            tally.fail(route, problem[0])
        assert problem is None, f"{problem[1]}\n{case.as_curl_command()}\n{response.text[:2000]}"

    one()


def _cases(op: APIOperation, model: str) -> st.SearchStrategy[Case]:
    """Half the cases aimed at a 200 (_aimed), half of those streamed; a quarter positive,
    capped (_cheap), which stop at a 404 for their model or a 400 for a rule between fields that
    the schema cannot state; a quarter negative, as generated."""
    positive = op.as_strategy(GenerationMode.POSITIVE).map(_cheap)
    aimed = positive.map(lambda case: _aimed(case, model))
    streamed = aimed.map(_streamed)
    return st.one_of(aimed, streamed, positive, op.as_strategy(GenerationMode.NEGATIVE))


def _cheap(case: Case) -> Case:
    """At most MAX_TOKENS tokens, MAX_N choices and MAX_PROMPTS prompts: a case may still be
    refused for its other values, which is the point, but none decodes to the context limit."""
    if not isinstance(case.body, dict) or not case.operation.path.startswith("/v1/"):
        return case  # /tokenize, /detokenize: nothing decodes
    body: dict[str, Any] = dict(case.body)
    limits = ["max_tokens", "max_completion_tokens"] if "messages" in body else ["max_tokens"]
    if all(body.get(k) is None for k in limits):
        body["max_tokens"] = MAX_TOKENS
    for key, most in {**dict.fromkeys(limits, MAX_TOKENS), "n": MAX_N}.items():
        if isinstance(body.get(key), int | float) and body[key] > most:
            body[key] = most
    if isinstance(body.get("prompt"), list) and _all(body["prompt"], list | str):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
    case.body = body
    return case


def _aimed(case: Case, model: str) -> Case:
    """For the served model, with the rules between fields that the schema does not state kept
    (each is a 400 of its own, which the other cases reach)."""
    if case.path_parameters:
        # encoded as schemathesis keeps path parameters; a checkpoint's path has slashes
        case.path_parameters = {**case.path_parameters, "name": quote(model, safe="")}
    if not isinstance(case.body, dict):
        return case
    body: dict[str, Any] = copy.deepcopy(case.body)
    body["model"] = model
    if body.get("stream_options") is not None:
        body["stream"] = True
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
    for message in body.get("messages") or ():
        if isinstance(message, dict) and message.get("role") == "tool":
            message["tool_call_id"] = message.get("tool_call_id") or "call-0"
    if case.operation.path == "/tokenize" and (body.get("prompt") is None) == (
        body.get("messages") is None
    ):
        body.pop("messages", None)
        body["prompt"] = body.get("prompt") or ""
    if isinstance(body.get("tokens"), list):  # /detokenize
        body["tokens"] = _token_ids(body["tokens"])
    if body.get("prompt") in ("", []):
        body["prompt"] = "x"
    if isinstance(body.get("prompt"), list):
        body["prompt"] = _token_ids(body["prompt"])
    case.body = body
    return case


def _streamed(case: Case) -> Case:
    if isinstance(case.body, dict) and case.operation.path.startswith("/v1/"):
        case.body = {**case.body, "stream": True}
    return case


def _all(value: object, kind: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, kind) for x in value)


def _token_ids(value: Any) -> Any:
    """The numbers in a prompt's (or /detokenize's) lists as ids in the vocabulary, integers:
    JSON's 1.0 is one to the schema, not to the gateway."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value) % TINY_HF["vocab_size"]
    return [_token_ids(x) for x in value] if isinstance(value, list) else value


def _problem(status: int, content_type: str, text: str) -> tuple[str, str] | None:
    """(kind, what) when the answer breaks the API's contract; None when it keeps it."""
    if status >= 500:
        return "5xx", f"status {status}"
    if status >= 400:
        return None if _openai_error(text) else ("not_openai_shape", f"status {status}")
    if content_type.startswith("text/event-stream"):
        return None if _events_read(text) else ("unreadable_2xx", "server-sent events")
    if not content_type.startswith("application/json"):
        return None  # /metrics: Prometheus' text (content_type_conformance checks the type)
    try:
        json.loads(text)
    except ValueError:
        return "unreadable_2xx", "not JSON"
    return None


def _undocumented(case: Case, response: schemathesis.Response) -> tuple[str, str] | None:
    """schemathesis' checks against the schema: the status, content type and body are those
    it documents, and a case that breaks the schema is refused."""
    try:
        case.validate_response(response, checks=SCHEMA_CHECKS)
    except (Failure, FailureGroup) as e:
        return "not_as_documented", str(e)
    return None


def _openai_error(text: str) -> bool:
    """``{"error": {"message": str, "type": str, "param": str|null, "code": str|null}}``."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) and set(body) == {"error"} else None
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and all(err[k] is None or isinstance(err[k], str) for k in ("param", "code"))
    )


def _events_read(text: str) -> bool:
    """Every event is JSON with choices (an error in the stream is a failure: refusals come
    before the status line), and the stream ends with [DONE]."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    if not events or events[-1] != "[DONE]":
        return False
    try:
        bodies = [json.loads(e) for e in events[:-1]]
    except ValueError:
        return False
    return all(isinstance(b, dict) and "choices" in b for b in bodies)
