"""The scheduler: per-request orchestration across prefill and decode workers."""
