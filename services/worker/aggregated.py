"""AggregatedWorker: prefill and decode of a request in one engine, nothing moved between
workers (an "aggregated" deployment in vLLM's and Dynamo's terms)."""

from __future__ import annotations

from ferry.services.worker.decode import DecodeWorker


class AggregatedWorker(DecodeWorker):
    """Prefill and decode of a request in one engine: nothing moves between workers. It serves
    the DecodeWorker API; a Decode without a kv_handle is prefilled here (chunked, with the
    prefix cache, batched with the running decodes), one with a kv_handle is a plain decode."""

    role = "aggregated"
    prefills = True
