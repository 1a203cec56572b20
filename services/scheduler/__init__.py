"""The scheduler: the cluster's request router. It places each request on its workers (an
aggregated one, or a prefill then a decode one), retries, falls back and migrates it when a
worker fails. It batches nothing: batching is the engine's step planner, in each worker
(services/engine/step_planner.py)."""
