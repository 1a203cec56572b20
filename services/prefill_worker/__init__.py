"""The prefill worker: batched prefill with the prefix cache, first token, KV export."""
