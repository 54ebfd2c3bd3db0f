# vmsandbox: the two front-door commands are `make demo` and `make test` (both run the
# idempotent host set-up first). Everything else here is for development.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint unit integration bench stop-host proto cluster cluster-down

setup:
	scripts/setup-host.sh

demo: setup
	scripts/demo.sh

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy vmsandbox shim tests bench

unit:
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration: setup
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

bench: setup
	$(PY) bench/sandbox_start.py
	$(PY) bench/admission.py
	$(PY) bench/placement.py
	$(PY) bench/image_pull.py
	$(PY) bench/pod_network.py

stop-host:
	scripts/stop-host.sh

# A one-node Kubernetes cluster on vmsandbox: `make cluster KUBE_BIN=DIR` (DIR holds kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet and kubectl), `make cluster-down` to stop it.
KUBE_BIN ?=
cluster: setup
	@test -n "$(KUBE_BIN)" || { echo "usage: make cluster KUBE_BIN=DIR (the Kubernetes binaries)" >&2; exit 2; }
	scripts/cluster.sh up "$(KUBE_BIN)"

cluster-down:
	scripts/cluster.sh down

proto:
	scripts/gen-proto.sh
