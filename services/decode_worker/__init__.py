"""The decode worker: KV import, continuous-batching decode, token streaming."""
