"""Ferry's serving side. Its subpackages are of two kinds; the gateway, the cluster's front door
(an OpenAI-compatible HTTP and gRPC API), is a process too, in the top-level ``gateway``.

Processes, each run by ``ferry serve ROLE``; they talk gRPC and the cluster's registry in Redis,
never import each other (the import-linter contracts in pyproject.toml):

- ``scheduler``: the cluster's request router (prefill, decode or aggregated workers);
- ``worker``: the engine workers, one role per process (prefill, decode, aggregated);
- ``eplb_controller``: expert placement across a DEP group's ranks.

Libraries, imported by the processes:

- ``engine``: the model, its KV cache and the step loop a worker runs (no gRPC, no Redis);
- ``kv_transfer``: moving a prefill's KV blocks to a decode worker;
- ``common``: what every process shares (the server's shape, the registry, config, logging,
  tracing, conversions).
"""
