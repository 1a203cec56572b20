"""Server-sent events as the OpenAI API streams them, read with ``requests``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import requests


def sse_events(resp: requests.Response) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    for line in resp.iter_lines(chunk_size=None):
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            return
        yield json.loads(data)
