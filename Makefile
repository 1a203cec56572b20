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

.PHONY: setup protos view run test check-install lint format pytest fuzz bench bench-engine bench-kv bench-services bench-wide-ep bench-eplb bench-serve bench-ucx-wedge bench-migration bench-structured bench-kernels bench-cuda-graphs tune-kernels profile-decode profile-served bench-decode-attention bench-peer chaos simulate test-slow clean redis

setup: redis $(STAMP)

# Re-install when pyproject.toml changes; torch first so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	@echo "make: installing Ferry into $(VENV) (a few minutes on a fresh machine)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip 2>&1 | $(QUIET)
	@echo "make: torch $(TORCH_VERSION), the CPU build"
	@$(PIP) "torch==$(TORCH_VERSION)" 2>&1 | $(QUIET)
	@echo "make: Ferry and its dependencies (pyproject.toml)"
	@$(PIP) -e '.[dev]' 2>&1 | $(QUIET)
	@touch $(STAMP)
	@echo "make: installed"

# redis-server; setpriv (util-linux), which starts ferry up's children to die with it; ip
# (iproute2), iptables and libnetfilter-queue (NetfilterQueue builds on it), which make, break
# and slow `ferry up --hosts`' hosts and links. Before the venv: pip builds NetfilterQueue.
SYSTEM_PACKAGES := redis-server util-linux iproute2 iptables libnetfilter-queue-dev
redis:
	@command -v redis-server >/dev/null && command -v setpriv >/dev/null \
	  && command -v ip >/dev/null && command -v iptables >/dev/null \
	  && dpkg -s libnetfilter-queue-dev >/dev/null 2>&1 || { \
	  echo "installing $(SYSTEM_PACKAGES) (apt-get)"; \
	  apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES); }

# Regenerate protos/*_pb2*.py from protos/*.proto (tests fail when they are stale). The .proto
# files are read as ferry/protos/*.proto, so the generated code imports `ferry.protos`.
protos: setup
	@rm -rf build/protos && mkdir -p build/protos
	$(PY) -m grpc_tools.protoc -Iferry/protos=protos --python_out=build/protos \
	  --grpc_python_out=build/protos --pyi_out=build/protos protos/*.proto
	cp build/protos/ferry/protos/* protos/

run: setup
	@echo "make: ferry up: the tiny model, a private redis-server, the OpenAI API on :8000"
	@$(VENV)/bin/ferry up

# mypy and lint-imports read the packages under the names they install as: build/view/ferry/*
# link to the folders.
VIEW := build/view
PACKAGES := services gateway kernels infra protos
view:
	@mkdir -p $(VIEW)/ferry
	@for p in $(PACKAGES); do ln -sfn ../../../$$p $(VIEW)/ferry/$$p; done

lint: setup view
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPYPATH=$(VIEW) $(VENV)/bin/mypy -p ferry
	PYTHONPATH=$(VIEW) $(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# `make test` stays under 15 minutes here (~13): the tests marked slow (whole clusters of the V4
# model, the Triton interpreter over a whole model, the benchmark scripts' and Locust's smoke runs;
# ~2.5 min) run in `make test-slow`, which CI runs after it
pytest: setup
	$(VENV)/bin/pytest -q tests --ignore=tests/fuzz -m "not slow"

test-slow: setup
	$(VENV)/bin/pytest -q tests --ignore=tests/fuzz -m slow

# schemathesis over the REST API's OpenAPI schema and hypothesis over the public gRPC API, against
# a `ferry up` of the tiny model: no 5xx, INTERNAL or UNKNOWN for a client's mistake, every error
# in its documented shape (~2.5 min here) -> loadtest/results/fuzz.json
fuzz: setup
	$(VENV)/bin/pytest -q tests/fuzz

# Ferry built and installed (not editable) into a fresh venv beside Hugging Face's `kernels` and
# the newest transformers the requirement admits: both import, from outside the checkout. Then
# the V3 parity tests run there on each transformers version the requirement admits (~3 min).
CHECK_VENV := build/check-install
TRANSFORMERS_VERSIONS := 5.24.0 5.25.0
check-install:
	rm -rf $(CHECK_VENV) && $(PYTHON) -m venv $(CHECK_VENV)
	$(CHECK_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==$(TORCH_VERSION)" 2>&1 | $(QUIET)
	$(CHECK_VENV)/bin/python -m pip install -q --disable-pip-version-check . kernels pytest pytest-timeout 2>&1 | $(QUIET)
	cd / && $(abspath $(CHECK_VENV))/bin/python -c "import kernels, transformers, ferry.kernels, \
	  ferry.services.engine.engine, ferry.gateway.app; from transformers import DeepseekV3ForCausalLM; \
	  assert 'site-packages' in ferry.kernels.__file__ and kernels.__file__ != ferry.kernels.__file__; \
	  print('transformers', transformers.__version__, 'beside kernels: both import')"
	for v in $(TRANSFORMERS_VERSIONS); do \
	  $(CHECK_VENV)/bin/python -m pip install -q --disable-pip-version-check "transformers==$$v" 2>&1 | $(QUIET); \
	  $(CHECK_VENV)/bin/pytest -q -p no:cacheprovider tests/unit/test_model_parity.py \
	    tests/unit/test_engine_parity.py tests/unit/test_mla_paths.py \
	    tests/unit/test_model_parity_v4.py; done

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

# One user's decode step, in-process: forward vs the rest, and the operators it launches
profile-decode: setup
	$(PY) loadtest/profile_decode.py $(BENCH_ARGS)

# One user's served token, hop by hop (engine, asyncio, decode worker, scheduler, gateway gRPC,
# SSE): TPOT at each and each process's CPU per token (~3 min here)
profile-served: setup
	$(PY) loadtest/profile_served.py $(BENCH_ARGS)

# decode attention on the CPU, the C kernel beside the torch path (~3 min) -> loadtest/results/decode-attention-cpu.json
bench-decode-attention: setup
	$(PY) loadtest/bench_decode_attention.py $(BENCH_ARGS)

# Ferry against llama.cpp's llama-server on the same weights (tiny → GGUF): logits, one user
# in-process, then served at 1/8/32 sessions. Builds llama-server from the llama-cpp-python sdist
# into build/peer once (~10 min on 2 cores); ~10 min more -> loadtest/results/peer-llamacpp.*
bench-peer: setup
	$(PY) loadtest/bench_peer.py $(BENCH_ARGS)

# faults across hosts (network namespaces; root): loadtest/results/chaos.json. --short: ~5 min
chaos: setup
	$(PY) loadtest/chaos.py $(BENCH_ARGS)

# the seed's setting simulated: DeepSeek-V4-Flash on 72 GB300, the default sweep (~3-5 min)
simulate: setup
	$(VENV)/bin/ferry simulate --hardware gb300 --gpus 72 --model deepseek-v4-flash \
	  --out loadtest/results/simulate-gb300 $(BENCH_ARGS)

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

# each Triton kernel checked and timed at DeepSeek-V3 shapes, then the small model on each backend
# (needs a CUDA GPU) -> loadtest/results/kernels.json, kernels_model.json
bench-kernels: setup
	$(PY) -m ferry.kernels.bench $(BENCH_ARGS)
	$(PY) loadtest/bench_model_kernels.py

# on a CUDA host: the small model's whole decode step eager and as CUDA graphs, batch 1..256
# -> loadtest/results/cuda-graphs-small.json (says so and exits 0 without a GPU)
bench-cuda-graphs: setup
	$(PY) loadtest/bench_cuda_graphs.py $(BENCH_ARGS)

tune-kernels: setup
	$(PY) -m ferry.kernels.tune $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
