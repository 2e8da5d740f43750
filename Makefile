# fairserve: two commands do everything on a fresh machine.
#   make run   - venv, install, prepare the default model, start all services
#   make test  - venv, install, run the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/fairserve/v1/*.proto)
GEN_STAMP := fairserve/v1/.stamp

.PHONY: run test install secrets compose-up compose-down proto config-docs prepare-model bench-scale bench-engine bench-profile bench-longkv bench-bf16 bench-prefix bench-memory bench-grammar bench-structured bench-isolation bench-ab bench-serving bench-lora-serving bench-peers chaos loadsim locust unit integration clean image

$(STAMP): requirements.txt requirements-runtime.txt pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP) $(GEN_STAMP)

$(GEN_STAMP): $(PROTOS) scripts/gen_protos.py $(STAMP)
	$(PY) scripts/gen_protos.py
	touch $(GEN_STAMP)

proto: $(GEN_STAMP)

# docs/config.md from the settings schemas (a test fails when it is stale).
config-docs: install
	$(PY) -m fairserve.cli.reference > docs/config.md

prepare-model: install
	$(PY) -m common.model_store

run: install prepare-model
	$(VENV)/bin/fairserve run

test: install prepare-model
	$(PY) -m pytest -q tests

unit: install
	$(PY) -m pytest -q tests --ignore=tests/integration

integration: install
	$(PY) -m pytest -q tests/integration

# How many workers one scheduler keeps busy: the real scheduler and kvcache with simulated workers
# (an H200 step-time model; docs/scaling.md), JSON rows and a plot; ARGS="--quick" checks it in seconds.
bench-scale: install
	$(PY) -m benchmarks.scale_bench --workers 1,16,64 --seconds 20 --out docs/scale_bench.json \
		--plot docs/scale_bench.png $(ARGS)

bench-engine: install prepare-model
	$(PY) -m benchmarks.engine_bench --rounds 3

# Where a concurrency-32 W1 run's step time goes (engine in-process, timers per part, the GEMMs
# against oneDNN's float32 rate on the same shapes; docs/engine/profile.md); ARGS="--served" adds the
# worker's wait between steps in a served run, ARGS="--quick" checks it on the tiny model.
bench-profile: install prepare-model
	$(PY) -m benchmarks.step_profile $(ARGS)

# Perplexity of a 16k-token text scored streaming under full, window, sink and h2o at budgets
# 256/512/1024, and KV memory and decode tok/s at 8k context, full against sink
# (docs/benchmarks.md); ARGS="--quick" checks it on the tiny model.
bench-longkv: install prepare-model
	$(PY) -m benchmarks.longkv_bench $(ARGS)

# CPU_COMPUTE=bfloat16 against float32 in one run: prefill and batched-decode tok/s, greedy
# agreement over 20 prompts x 64 tokens and perplexity of 4,096 tokens of text (docs/benchmarks.md);
# needs a CPU with BF16 instructions; ARGS="--quick" checks it on the tiny model.
bench-bf16: install prepare-model
	$(PY) -m benchmarks.bf16_bench $(ARGS)

# Prefix caching through the gateway: TTFT cold / warm prefix / identical and where each went
# (the services' spans), sessions over two workers, n choices (~3 min; ARGS="--ttft-only")
bench-prefix: install prepare-model
	$(PY) -m benchmarks.prefix_cache_bench $(ARGS)

# The engine's memory-saving settings (CPU_PREFILL_WEIGHTS=codes; lean: + narrow codes, no
# screen) against its defaults: prefill and decode tok/s alternating, and each one's resident
# memory at 64 blocks in a fresh process (docs/benchmarks.md).
bench-memory: install prepare-model
	$(PY) -m benchmarks.memory_modes_bench $(ARGS)

# The grammar engines (xgrammar, llguidance) on the default model's vocabulary (docs/engine/structured-output.md);
# installs xgrammar first (requirements-bench.txt, not part of `make install`).
bench-grammar: install prepare-model
	$(PIP) install -q -r requirements-bench.txt
	$(PY) -m benchmarks.grammar_engine_bench $(ARGS)

# TPOT at 8 concurrent streams with a JSON schema against without one, alternating rounds
# (docs/benchmarks.md); ARGS="--quick" checks it on the tiny model.
bench-structured: install prepare-model
	$(PY) -m benchmarks.structured_bench $(ARGS)

# Two stacks side by side on W1, rounds alternating, B against A paired by round: a change against
# the commit before it (ARGS="--b-tree ../before") or a setting (ARGS="--b-env NAME=VALUE").
bench-ab: install prepare-model
	$(PY) -m benchmarks.ab_stacks $(ARGS)

# One tenant's longest gap between streamed tokens, alone and while another floods /tokenize
# with 750 KB texts from 2 threads (docs/benchmarks.md, Isolation); ARGS="--quick" checks it
# on the tiny model.
bench-isolation: install prepare-model
	$(PY) -m benchmarks.isolation_bench $(ARGS)

# The same workload against fairserve, vLLM (CPU build), llama.cpp's llama-server and
# transformers serve, one at a time (~30 min); results.json, table.md and PNG curves under
# .cache/bench-serving/<time>. Peers not set up are skipped with a line saying so:
#   make bench-peers                     # once: vLLM's venv and llama-server's build (~20 min)
#   make bench-serving ARGS="--quick"    # tiny model: checks the harness
bench-serving: install prepare-model
	$(PY) -m benchmarks.head_to_head $(ARGS)

# Multi-LoRA serving: fairserve and vLLM's CPU LoRA on the same random adapters (1, 4, 16 at
# concurrency 8 and 32) against each one's base-only throughput.
bench-lora-serving: install prepare-model
	$(PY) -m benchmarks.lora_serving $(ARGS)

bench-peers: install
	$(PY) -m benchmarks.head_to_head.peers $(ARGS)

# Kills a worker, the scheduler, the KV index, the gateway (background /v1/responses streams,
# resumed), all but the gateway in a cascade, and Redis (if installed) mid-stream, in turn, with
# two workers and then one, and checks every stream against an undisturbed run (exit 1 on a loss,
# a difference, a repeat or a 5xx); report under .cache/chaos/<time>:
#   make chaos   or   make chaos ARGS="--quick"   (tiny model, 4 streams of 40 tokens)
chaos: install prepare-model
	$(PY) -m benchmarks.chaos $(ARGS)

# Simulated users against a running gateway (`make run` in another shell):
#   make loadsim ARGS="--users 16 --duration 120"   or   ARGS="--rates 0.5,1,2 --requests 40"
loadsim: install
	$(PY) -m loadsim $(ARGS)

# Locust, headless, against a running gateway; CSV and HTML reports under .cache/locust/<time>:
#   make locust ARGS="--users 16 --spawn-rate 4 --run-time 60s"   (HOST=http://host:port for another gateway)
HOST := http://127.0.0.1:8000
locust: install
	@dir=.cache/locust/$$(date -u +%Y%m%dT%H%M%SZ); mkdir -p $$dir; \
	$(VENV)/bin/locust -f loadsim/locustfile.py --headless --host $(HOST) --users 8 --spawn-rate 4 \
		--run-time 60s --stop-timeout 30 --csv $$dir/locust --html $$dir/report.html $(ARGS); status=$$?; \
	echo "Locust reports: $$dir/report.html and $$dir/locust_*.csv"; exit $$status

# Container images, one per service (deploy/Dockerfile's stages), with docker or
# podman, whichever is installed; tagged with the version and `latest`:
#   make image                                   # CPU torch from download.pytorch.org
#   make image VARIANT=cuda TORCH_INDEX_URL=     # PyPI's (CUDA) torch: fairserve-worker:<version>-cuda
#   make image TORCH_INDEX_URL= BUILD_FLAGS="-v /opt/wheels:/opt/wheels:ro -v $$PWD/pip.conf:/etc/pip.conf:ro"
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# docker when its daemon answers, else podman (CONTAINER=... overrides).
CONTAINER ?= $(shell docker info >/dev/null 2>&1 && command -v docker || command -v podman 2>/dev/null || command -v docker 2>/dev/null)
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
VARIANT ?= cpu
IMAGE_SERVICES ?= $(if $(filter cuda,$(VARIANT)),worker,gateway scheduler kvcache worker proxy)
TAG_SUFFIX := $(if $(filter cuda,$(VARIANT)),-cuda,)
BUILD_FLAGS ?=

image:
	@test -n "$(CONTAINER)" || { echo "make image: neither docker nor podman is installed" >&2; exit 1; }
	for service in $(IMAGE_SERVICES); do \
	  $(CONTAINER) build $(if $(findstring podman,$(CONTAINER)),--format docker,) -f deploy/Dockerfile \
	    --target $$service --build-arg VERSION=$(VERSION) --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) \
	    $(BUILD_FLAGS) -t fairserve-$$service:$(VERSION)$(TAG_SUFFIX) -t fairserve-$$service:latest$(TAG_SUFFIX) . || exit 1; \
	done

# Compose on one host (docs/deploy.md): `make compose-up` makes the secrets deploy/compose.yaml
# mounts the first time (`make secrets`: random tokens, an empty gateway.env; an existing file is
# never changed), checks them, then brings the stack up with docker compose or podman-compose:
#   make compose-up ARGS="--scale worker=3"     make compose-down
COMPOSE ?= $(shell if docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; \
	then echo docker compose; else command -v podman-compose 2>/dev/null; fi)
secrets:
	$(PYTHON) scripts/compose_secrets.py make

compose-up: secrets
	@$(PYTHON) scripts/compose_secrets.py check
	@test -n "$(COMPOSE)" || { echo "make compose-up: neither docker compose nor podman-compose is installed" >&2; exit 1; }
	$(COMPOSE) -p fairserve -f deploy/compose.yaml up -d $(ARGS)

compose-down:
	@test -n "$(COMPOSE)" || { echo "make compose-down: neither docker compose nor podman-compose is installed" >&2; exit 1; }
	$(COMPOSE) -p fairserve -f deploy/compose.yaml down

clean:
	rm -rf gen $(VENV)
