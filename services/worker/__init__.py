"""The engine workers, one process per role (``ferry serve prefill|decode|aggregated``):

- ``prefill.py``: ``PrefillWorker``, batched prefill with the prefix cache, first token, KV export;
- ``decode.py``: ``DecodeWorker``, KV import, continuous-batching decode, token streaming;
- ``aggregated.py``: ``AggregatedWorker``, prefill and decode of a request in one engine, over
  the decode worker's API.

They are built on ``engine_worker.py`` (``EngineWorker``: a service around one AsyncEngine,
with its registration, load and KV events in Redis and its health; ``WorkerServicer``: what
every role's servicer shares), its ``config`` (no torch: the CLI builds it), the
``placement_service`` a DEP rank serves to the EPLB controller, the ``engine_metrics`` every
worker exports and the role ``metrics`` each registers for itself, and the ``convert``
functions between engine outputs / KV handles and the ferry.v1 messages. Outside the package,
only the CLI imports it: ``config`` always, a role's module when it runs that role."""
