# Ferry: `make run` starts a local cluster, `make test` runs lint and the tests, `make help` lists
# every target. Each target's help is the `## ` text on its line; `##@ ` lines name the groups.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
# `make` alone sets up, as it always has; `make help` says what else there is.
.DEFAULT_GOAL := setup
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ferry-installed
TORCH_VERSION := 2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check
# pip warns about every file:// index that this machine's pip.conf names but lacks; drop those lines.
QUIET := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: help setup system-packages run test lint pytest test-slow fuzz check-install format clean \
  bench bench-engine bench-structured bench-kv bench-migration bench-ucx-wedge bench-eplb \
  bench-wide-ep bench-services bench-serve bench-peer bench-decode-attention profile-decode \
  profile-served bench-kernels bench-cuda-graphs tune-kernels chaos simulate protos view

##@ Set up, run and test

setup: system-packages $(STAMP) ## create .venv: torch (the CPU build), then Ferry with its dev extras; system-packages

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
system-packages: ## apt-get what is missing: redis-server util-linux iproute2 iptables libnetfilter-queue-dev
	@command -v redis-server >/dev/null && command -v setpriv >/dev/null \
	  && command -v ip >/dev/null && command -v iptables >/dev/null \
	  && dpkg -s libnetfilter-queue-dev >/dev/null 2>&1 || { \
	  echo "installing $(SYSTEM_PACKAGES) (apt-get)"; \
	  apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES); }

run: setup ## ferry up: the tiny model, a private redis-server, the OpenAI API on :8000
	@echo "make: ferry up: the tiny model, a private redis-server, the OpenAI API on :8000"
	@$(VENV)/bin/ferry up

test: lint pytest ## make lint, then make pytest

lint: setup view ## ruff check, ruff format --check, mypy -p ferry and lint-imports (the package boundaries)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPYPATH=$(VIEW) $(VENV)/bin/mypy -p ferry
	PYTHONPATH=$(VIEW) $(VENV)/bin/lint-imports

# `make test` stays under 15 minutes here: the tests marked slow (whole clusters of the V4
# model, the Triton interpreter over a whole model, the benchmark scripts' and Locust's smoke runs,
# the docs' examples) run in `make test-slow`, which CI runs after it
pytest: setup ## the tests not marked slow (tests/unit, tests/kernels, tests/integration)
	$(VENV)/bin/pytest -q tests --ignore=tests/fuzz -m "not slow"

test-slow: setup ## the tests marked slow: V4 clusters, interpreted kernels, smoke runs, the docs' examples
	$(VENV)/bin/pytest -q tests --ignore=tests/fuzz -m slow

# schemathesis over the REST API's OpenAPI schema and hypothesis over the public gRPC API, against
# a `ferry up` of the tiny model: no 5xx, INTERNAL or UNKNOWN for a client's mistake, every error
# in its documented shape -> loadtest/results/fuzz.json
fuzz: setup ## fuzz the REST and gRPC APIs of a local cluster -> loadtest/results/fuzz.json
	$(VENV)/bin/pytest -q tests/fuzz

# Ferry built and installed (not editable) into a fresh venv beside Hugging Face's `kernels` and
# the newest transformers the requirement admits: both import, from outside the checkout. Then
# the V3 parity tests run there on each transformers version the requirement admits.
CHECK_VENV := build/check-install
TRANSFORMERS_VERSIONS := 5.24.0 5.25.0
check-install: ## install Ferry into a fresh venv beside HF's kernels; parity tests per transformers
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

format: setup ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean: ## remove .venv and the tools' caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

##@ Benchmarks (BENCH_ARGS="..." passes flags; each writes loadtest/results/, see loadtest/README.md)

bench: bench-engine bench-kv bench-services bench-wide-ep bench-eplb bench-serve bench-ucx-wedge bench-migration bench-structured ## the CPU benchmarks, one after another

# BENCH_ARGS, e.g. "--hf-requests 32" to time transformers on fewer requests
bench-engine: setup ## Ferry's engine against transformers generate -> engine.json
	$(PY) loadtest/bench_engine.py $(BENCH_ARGS)

bench-structured: setup ## decoding with a grammar beside free decoding, and compile times -> structured.json
	$(PY) loadtest/bench_structured.py $(BENCH_ARGS)

bench-kv: setup ## KV transfer GB/s and latency per transport -> kv_transfer.json
	$(PY) loadtest/bench_kv_transfer.py $(BENCH_ARGS)

bench-migration: setup ## a decode worker, then a scheduler, killed under 8 streams -> migration*.json
	$(PY) loadtest/bench_migration.py $(BENCH_ARGS)
	$(PY) loadtest/bench_migration.py --kill scheduler --out loadtest/results/migration_scheduler.json $(BENCH_ARGS)

bench-ucx-wedge: setup ## UCX importers wedged by exporters killed mid-pull, and the probe -> ucx_wedge.json
	$(PY) loadtest/ucx_wedge.py $(BENCH_ARGS)

bench-eplb: setup ## EPLB placement against DeepSeek's published algorithm -> eplb.json
	$(PY) loadtest/bench_eplb.py $(BENCH_ARGS)

bench-wide-ep: setup ## one MoE layer at 2 and 4 ranks, DEP2 against two workers -> wide_ep.json
	$(PY) loadtest/bench_wide_ep.py $(BENCH_ARGS)

bench-services: setup ## 64 requests through ferry up against the in-process engine -> services.json
	$(PY) loadtest/bench_services.py $(BENCH_ARGS)

bench-serve: setup ## AgentX-like sessions through ferry up, 4 configurations -> serve-*.json, .png
	$(PY) loadtest/sweep.py $(BENCH_ARGS)

# Ferry against llama.cpp's llama-server on the same weights (tiny → GGUF): logits, one user
# in-process, then served at 1/8/32 sessions. Builds llama-server from the llama-cpp-python sdist
# into build/peer once.
bench-peer: setup ## Ferry against llama.cpp's llama-server on the same weights -> peer-llamacpp.*
	$(PY) loadtest/bench_peer.py $(BENCH_ARGS)

bench-decode-attention: setup ## CPU decode attention, the C kernel beside torch -> decode-attention-cpu.json
	$(PY) loadtest/bench_decode_attention.py $(BENCH_ARGS)

profile-decode: setup ## one user's decode step in-process, eager and compiled -> profile-decode-*.json
	$(PY) loadtest/profile_decode.py $(BENCH_ARGS)

# One user's served token, hop by hop (engine, asyncio, decode worker, scheduler, gateway gRPC,
# SSE): TPOT at each and each process's CPU per token
profile-served: setup ## one user's token through ferry up, hop by hop -> profile-served-tiny.json
	$(PY) loadtest/profile_served.py $(BENCH_ARGS)

# each Triton kernel checked and timed at DeepSeek-V3 shapes, then the small model on each backend
bench-kernels: setup ## CUDA: Triton kernels against torch, and the small model -> kernels*.json
	$(PY) -m ferry.kernels.bench $(BENCH_ARGS)
	$(PY) loadtest/bench_model_kernels.py

# says so and exits 0 without a GPU
bench-cuda-graphs: setup ## CUDA: the small model's decode step eager and as CUDA graphs -> cuda-graphs-small.json
	$(PY) loadtest/bench_cuda_graphs.py $(BENCH_ARGS)

tune-kernels: setup ## CUDA: every tiling of mla_decode, fused_moe, prefill_attention -> kernel_tuning.json
	$(PY) -m ferry.kernels.tune $(BENCH_ARGS)

# faults across hosts (network namespaces; root). --short: one fault of each kind (CI)
chaos: setup ## root: one fault at a time on a ferry up --hosts cluster under load -> chaos.json
	$(PY) loadtest/chaos.py $(BENCH_ARGS)

# the seed's setting simulated: DeepSeek-V4-Flash on 72 GB300, the default sweep
simulate: setup ## ferry simulate of DeepSeek-V4-Flash on 72 GB300 -> simulate-gb300/
	$(VENV)/bin/ferry simulate --hardware gb300 --gpus 72 --model deepseek-v4-flash \
	  --out loadtest/results/simulate-gb300 $(BENCH_ARGS)

##@ Tools

help: ## this list
	@awk 'BEGIN { FS = ":.*## " } \
	  /^##@ / { printf "\n%s\n", substr($$0, 5) } \
	  /^[a-z][a-zA-Z0-9_-]*:([^=]|$$).*## / { printf "  %-24s %s\n", $$1, $$2 }' \
	  $(firstword $(MAKEFILE_LIST))

# Regenerate protos/*_pb2*.py from protos/*.proto (tests fail when they are stale). The .proto
# files are read as ferry/protos/*.proto, so the generated code imports `ferry.protos`.
protos: setup ## regenerate protos/*_pb2*.py from protos/*.proto
	@rm -rf build/protos && mkdir -p build/protos
	$(PY) -m grpc_tools.protoc -Iferry/protos=protos --python_out=build/protos \
	  --grpc_python_out=build/protos --pyi_out=build/protos protos/*.proto
	cp build/protos/ferry/protos/* protos/

# mypy and lint-imports read the packages under the names they install as: build/view/ferry/*
# link to the folders.
VIEW := build/view
PACKAGES := services gateway kernels infra protos
view: ## link build/view/ferry/* to the folders, for mypy and lint-imports
	@mkdir -p $(VIEW)/ferry
	@for p in $(PACKAGES); do ln -sfn ../../../$$p $(VIEW)/ferry/$$p; done
