# vmsandbox: the two front-door commands are `make demo` and `make test` (both run the
# idempotent host set-up first). Everything else here is for development.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

# the benchmarks `make bench` runs; bench/cpu_readback.py and bench/qemu_direct.py measure parts that
# bench/sandbox_start.py reports beside its own figures, and run alone on demand, as does
# bench/restore_floor.py (a restore's parts beside bare QEMU loading the same saved guest) and
# bench/image_adopt.py (shim mode's disk from containerd's layers beside vmsandbox's own pull)
BENCHMARKS := sandbox_start admission placement image_pull pod_network container_start cri_scale resize cluster_start density

.PHONY: setup demo test lint unit integration bench perf-table bench-smoke stop-host proto cluster cluster-down k8s-tools

setup:
	scripts/setup-host.sh

demo: setup
	scripts/demo.sh

# `make test`: host set-up, lint, then the suite in two parallel phases (scripts/test.sh says how);
# JOBS pytest-xdist workers (default: one more than the CPUs), PYTEST_ARGS passed to every run.
JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: setup lint
	JOBS=$(JOBS) PY=$(PY) scripts/test.sh $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy vmsandbox shim cli tests bench

# the tests that start no guest, but the fixed-time fuzz campaigns (make test runs those too)
unit:
	$(PY) -m pytest -n $(JOBS) -m "not integration and not fuzz" $(PYTEST_ARGS)

integration: setup
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

# each benchmark's JSON is kept in bench/results/ (a failed one keeps its last), then the README's table
bench: setup
	mkdir -p bench/results
	for b in $(BENCHMARKS); do \
		$(PY) bench/$$b.py >bench/results/$$b.json.new && mv bench/results/$$b.json.new bench/results/$$b.json || \
			{ rm -f bench/results/$$b.json.new; exit 1; }; \
	done
	$(PY) bench/table.py

# the README's performance table from the JSON in bench/results/
perf-table:
	$(PY) bench/table.py

# every bench/*.py with --smoke: its fewest runs and a check of its JSON (make test runs this too)
bench-smoke: setup
	$(PY) -m pytest tests/integration/test_bench_smoke.py $(PYTEST_ARGS)

stop-host:
	scripts/stop-host.sh

# A one-node Kubernetes cluster on vmsandbox: `make cluster` (Kubernetes, etcd, containerd, cri-tools and
# CoreDNS of pin K8S_PIN, default 1.37, built by scripts/build-k8s.sh when missing; KUBE_BIN=DIR takes
# them from DIR instead), `make cluster-down` to stop it.
KUBE_BIN ?=
K8S_PIN ?=
cluster: setup
	K8S_PIN=$(K8S_PIN) scripts/cluster.sh up $(KUBE_BIN)

cluster-down:
	scripts/cluster.sh down

# Kubernetes, etcd, containerd and cri-tools built from the Go modules pinned in tools/k8s/ into
# /var/cache/vmsandbox/k8s/PIN/bin (only what a changed pin needs); `make k8s-tools K8S_PIN=1.34`
# for the oldest supported minor. The last line printed is the bin directory.
k8s-tools:
	scripts/build-k8s.sh $(K8S_PIN)

proto:
	scripts/gen-proto.sh
