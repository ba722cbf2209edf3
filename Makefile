# One entry point for people and CI. `make demo` and `make test` work on a fresh
# machine: they create the venv, install everything (apt packages as root too).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
APT_PACKAGES := nftables iproute2 miniupnpd-nftables chromium

.PHONY: all venv lock lock-upgrade lock-check system-deps interop-deps demo test test-fast mutate docs bench bench-dht bench-training bench-allreduce bench-datasets bench-gpu proto typecheck clean

all: test

# Exact versions with their hashes from requirements-dev.lock (make lock writes it from
# pyproject.toml); then the project itself, editable, with nothing more resolved.
$(STAMP): pyproject.toml requirements-dev.lock
	$(PYTHON) -m venv $(VENV)
	# torch inside the lock is the CPU build on local disk (pip's find-links); PyPI's is GBs of CUDA.
	$(PIP) install -q --require-hashes --no-deps -r requirements-dev.lock
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) check
	touch $(STAMP)

venv: $(STAMP)

## Rewrite requirements*.lock and bench/hivemind.lock from pyproject.toml and bench/hivemind.in (moving only what an edit needs).
lock:
	@test -x $(VENV)/bin/uv || { $(PYTHON) -m venv $(VENV) && $(PIP) install -q uv==0.13.9; }
	bash .ci/lock

## The same, taking the newest release of everything pyproject.toml allows.
lock-upgrade:
	@test -x $(VENV)/bin/uv || { $(PYTHON) -m venv $(VENV) && $(PIP) install -q uv==0.13.9; }
	bash .ci/lock --upgrade

## Fails when pyproject.toml and the lock files disagree (CI runs it first).
lock-check: venv
	bash .ci/lock --check

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
test: venv lock-check system-deps interop-deps
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 -n 2 --dist loadgroup

## docs/CLI.md's reference section, from the parser (tests/test_docs.py checks it is current).
docs: venv
	$(PY) .ci/cli_reference.py

## Mutation testing of the pure decision modules, a score per module (docs/TESTING.md; goal 90%).
mutate: venv
	$(PY) .ci/mutate.py --survivors

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

## The all-reduce against the Node's data plane and torch.distributed's gloo: 2/4/8 peers, 40/400 MB (docs/AVERAGING.md).
bench-allreduce: venv
	$(PY) bench/allreduce_speed.py

## Datasets from the swarm, dedloc vs libtorrent in one run: 16 peers on home links (4 behind NATs), 2 seeders (as root: the NAT lab).
bench-datasets: venv
	bash bench/setup_libtorrent.sh
	$(PY) bench/datasets.py

## A GPU volunteer's view: alone, 2 peers sync, 2 peers DPU on one GPU (needs CUDA; docs/AVERAGING.md).
bench-gpu: venv
	$(PY) bench/gpu_training.py

## Regenerate protobuf code (checked in) from every .proto file.
proto: venv
	PATH=$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I. --python_out=. --mypy_out=. $$(git ls-files '*.proto')

typecheck: venv
	$(PY) -m mypy p2p nat averaging training

clean:
	rm -rf $(VENV) .venv-hivemind .venv-libtorrent interop/node_modules interop/.node .pytest_cache .mypy_cache
