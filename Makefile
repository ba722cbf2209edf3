# One entry point for people and CI. `make demo` and `make test` work on a fresh
# machine: they create the venv, install everything (apt packages as root too).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
APT_PACKAGES := nftables iproute2 miniupnpd-nftables

.PHONY: all venv system-deps interop-deps demo test test-fast bench bench-dht bench-training proto typecheck clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build on local disk; an unpinned one pulls GBs.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,train]'
	touch $(STAMP)

venv: $(STAMP)

# Network namespaces and nftables for the NAT testbed; skipped when not root.
system-deps:
	@if [ "$$(id -u)" = 0 ]; then \
	  missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing; NAT tests will skip"; \
	  fi; \
	else echo "not root: skipping apt packages ($(APT_PACKAGES)); NAT tests will skip"; fi

interop-deps:
	bash interop/setup.sh

## The live local swarm: a bootstrap node and peers (as root behind namespace NATs, else on loopback), DHT, averaging, training.
demo: venv
	$(VENV)/bin/dedloc demo

## The whole suite, as CI runs it.
test: venv system-deps interop-deps
	$(PY) -m pytest -q -p no:cacheprovider --durations=20

test-fast: venv
	$(PY) -m pytest -q -m "not slow and not interop"

bench: venv
	$(PY) bench/connect_latency.py
	$(PY) bench/throughput.py
	$(PY) bench/tensor_roundtrip.py
	$(PY) bench/quic.py

## DHT latency and reliability, dedloc vs hivemind in one run (hivemind goes into .venv-hivemind).
bench-dht: venv
	bash bench/setup_hivemind.sh
	$(PY) bench/dht.py

## Collaborative training, dedloc vs hivemind.Optimizer in one run: samples/s of 1 vs 4 peers, overhead per step.
bench-training: venv
	bash bench/setup_hivemind.sh
	$(PY) bench/training.py

## Regenerate protobuf code (checked in) from every .proto file.
proto: venv
	PATH=$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I. --python_out=. --mypy_out=. $$(git ls-files '*.proto')

typecheck: venv
	$(PY) -m mypy p2p nat averaging training

clean:
	rm -rf $(VENV) interop/node_modules interop/.node .pytest_cache .mypy_cache
