"""A checkpoint without tokenizer.json and with a vocabulary too small for the byte-level
tokenizer, served end to end (`ferry up`, one aggregated worker) as vLLM's
--skip-tokenizer-init serves one: token-id prompts in, token ids out with empty text; what needs
text is a 400 (INVALID_ARGUMENT over gRPC) naming the field, before anything streams."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ferry.gateway.sdk import FerryClient, InvalidRequestError
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, ferry_up
from tests.helpers import Checkpoint

PROMPT = [5, 6, 7, 8, 9]
CHECKPOINT = Checkpoint(
    seed=7, lm_head_scale=20.0, config={"vocab_size": 200, "bos_token_id": 0, "eos_token_id": 1}
)


@pytest.fixture(scope="module")
def cluster(checkpoint: Path) -> Iterator[Cluster]:
    args = ("--model", str(checkpoint), "--aggregated", "1", "--num-kv-blocks", "64")
    with ferry_up("", *args, cluster="no-tokenizer") as c:
        yield c


Post = Callable[..., tuple[int, dict[str, Any]]]


@pytest.fixture(scope="module")
def post(cluster: Cluster, checkpoint: Path) -> Post:
    def post(path: str, **body: Any) -> tuple[int, dict[str, Any]]:
        """``body`` (for the checkpoint's model) to ``path``: the status and the JSON."""
        req = urllib.request.Request(
            cluster.gateway + path,
            data=json.dumps({"model": str(checkpoint), **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    return post


def test_a_token_id_completion_gives_the_engines_tokens_and_no_text(
    post: Post, checkpoint: Path
) -> None:
    status, out = post(
        "/v1/completions",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        logprobs=1,
    )
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    tokens = choice["logprobs"]["tokens"]  # vLLM's token_id:N, as there is no text to show
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = Engine(EngineConfig(model=str(checkpoint))).generate([PROMPT], params)[0]
    assert tokens == [f"token_id:{t}" for t in want.token_ids]
    assert out["usage"]["prompt_tokens"] == len(PROMPT)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hello"}, "prompt"),
        ("/v1/completions", {"prompt": "Hello", "stream": True}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
        ("/tokenize", {"prompt": "Hello"}, "prompt"),
        ("/detokenize", {"tokens": PROMPT}, "tokens"),
        ("/v1/completions", {"prompt": PROMPT, "stop": ["ab"], "stream": True}, "stop"),
        (
            "/v1/completions",
            {"prompt": PROMPT, "structured_outputs": {"regex": "[0-9]+"}},
            "response_format",
        ),
    ],
    ids=["text", "text-streamed", "chat", "tokenize", "detokenize", "stop-streamed", "structured"],
)
def test_what_needs_text_is_a_400_naming_the_field(
    post: Post, path: str, body: dict[str, Any], param: str
) -> None:
    status, out = post(path, **body)
    assert status == 400 and out["error"]["param"] == param, out
    assert "no tokenizer.json" in out["error"]["message"], out


def test_the_grpc_api_takes_token_ids_and_refuses_text(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc, max_retries=0) as sdk:
        done = sdk.complete(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
        assert len(done.token_ids) == 4 and done.text == ""
        with pytest.raises(InvalidRequestError) as refused:
            sdk.complete("Hello", max_tokens=4)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "send the prompt as token ids" in refused.value.message
