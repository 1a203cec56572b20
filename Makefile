# Ferry: `make run` starts a local cluster, `make test` runs lint and the tests.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ferry-installed
TORCH_VERSION := 2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check
# pip warns about every file:// index that this machine's pip.conf names but lacks; drop those lines.
QUIET := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: setup protos run test lint format pytest bench bench-engine bench-kv bench-services bench-wide-ep bench-eplb bench-serve bench-ucx-wedge bench-migration bench-structured bench-kernels tune-kernels clean redis

setup: $(STAMP) redis

# Re-install when pyproject.toml changes; torch first so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip 2>&1 | $(QUIET)
	$(PIP) "torch==$(TORCH_VERSION)" 2>&1 | $(QUIET)
	$(PIP) -e '.[dev]' 2>&1 | $(QUIET)
	@# Hugging Face's `kernels` distribution imports as `kernels`, like ours (see pyproject.toml).
	@! $(PY) -m pip show -q kernels >/dev/null 2>&1 || $(PY) -m pip uninstall -y -q kernels
	@touch $(STAMP)

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (apt-get)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# Regenerate protos/*_pb2*.py from protos/*.proto (tests fail when they are stale).
protos: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

run: setup
	$(VENV)/bin/ferry up

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy services gateway kernels infra protos

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

pytest: setup
	$(VENV)/bin/pytest -q tests

test: lint pytest

bench: bench-engine bench-kv bench-services bench-wide-ep bench-eplb bench-serve bench-ucx-wedge bench-migration bench-structured

bench-kv: setup
	$(PY) loadtest/bench_kv_transfer.py $(BENCH_ARGS)

# UCX importers wedged by exporters killed mid-pull, and whether the workers' probe sees it (~3 min)
bench-ucx-wedge: setup
	$(PY) loadtest/ucx_wedge.py $(BENCH_ARGS)

# A decode worker killed under 8 streaming requests (--migration-limit 1): stalls, outputs (~1 min)
# structured outputs: decode with and without a grammar side by side, and compile times (~15 s)
bench-structured: setup
	$(PY) loadtest/bench_structured.py $(BENCH_ARGS)

bench-migration: setup
	$(PY) loadtest/bench_migration.py $(BENCH_ARGS)
	$(PY) loadtest/bench_migration.py --kill scheduler --out loadtest/results/migration_scheduler.json $(BENCH_ARGS)

# 64 concurrent greedy requests through `ferry up` against the in-process engine (~2 min here)
bench-services: setup
	$(PY) loadtest/bench_services.py $(BENCH_ARGS)

# MoE layer dispatch/compute/combine at 2 and 4 ranks; DEP2 vs two independent workers (~1 min)
bench-wide-ep: setup
	$(PY) loadtest/bench_wide_ep.py $(BENCH_ARGS)

# AgentX-like sessions through `ferry up` at 1,2,4,8 live sessions x 30 s, 4 configurations
# (~10 min here) -> loadtest/results/serve-*.json, serve-pareto.png, serve-ttft.png
bench-serve: setup
	$(PY) loadtest/sweep.py $(BENCH_ARGS)

# EPLB placement vs the published algorithm: balance, runtime, slots moved on drift (~1 min)
bench-eplb: setup
	$(PY) loadtest/bench_eplb.py $(BENCH_ARGS)

# BENCH_ARGS, e.g. "--hf-requests 32" to time transformers on fewer requests (the full run takes ~1 h here)
bench-engine: setup
	$(PY) loadtest/bench_engine.py $(BENCH_ARGS)

# each Triton kernel checked and timed at DeepSeek-V3 shapes (needs a CUDA GPU) -> loadtest/results/kernels.json
bench-kernels: setup
	$(PY) -m kernels.bench $(BENCH_ARGS)

tune-kernels: setup
	$(PY) -m kernels.tune $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
