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
GEN_STAMP := gen/.stamp

.PHONY: run test install proto prepare-model bench-engine loadsim unit integration clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PY) scripts/link_paths.py
	touch $(STAMP)

install: $(STAMP) $(GEN_STAMP)

$(GEN_STAMP): $(PROTOS) scripts/gen_protos.py $(STAMP)
	$(PY) scripts/gen_protos.py gen
	touch $(GEN_STAMP)

proto: $(GEN_STAMP)

prepare-model: install
	$(PY) -m common.model_store

run: install prepare-model
	$(PY) -m scripts.run_stack

test: install prepare-model
	$(PY) -m pytest -q tests

unit: install
	$(PY) -m pytest -q tests --ignore=tests/integration

integration: install
	$(PY) -m pytest -q tests/integration

bench-engine: install prepare-model
	$(PY) -m benchmarks.engine_bench --rounds 3

# Simulated users against a running gateway (`make run` in another shell):
#   make loadsim ARGS="--users 16 --duration 120"   or   ARGS="--rates 0.5,1,2 --requests 40"
loadsim: install
	$(PY) -m loadsim $(ARGS)

clean:
	rm -rf gen $(VENV)
