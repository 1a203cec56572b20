"""What every engine worker is built of: ``EngineWorker`` (a service around one AsyncEngine:
registration, load and KV events in Redis, health), its ``config``, the ``placement_service`` a
DEP rank serves to the EPLB controller, the ``engine_metrics`` it exports, and the ``convert``
functions between engine outputs / KV handles and the ferry.v1 messages. The prefill, decode and
aggregated workers are built on it; nothing outside the workers imports it."""
