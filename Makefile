# The two commands (see README): `make up` runs the whole stack, `make test` runs every check.
# Each creates the virtual environment and installs what it needs on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest with bytecode written (an environment's PYTHONDONTWRITEBYTECODE=1 emptied, which Python reads
# as unset): pytest keeps each test module's assert-rewritten code only where bytecode may be
# written, so otherwise every pytest process (the unit tier, each of the three workers, the fallback
# pass) rewrote all ~200 test modules again: 19 CPU-s of a 29 s collection, 5 CPU-s with the cache
# the unit tier, run first, leaves (__pycache__/ is git-ignored; tests/test_base_install.py skips it).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest
NODE_STAMP := node_modules/.installed

.PHONY: up test test-unit lint typecheck protos protos-check docs docs-check buf-lint buf-breaking pytest pytest-nats-fallback bench bench-batcher bench-gpu bench-watch clean

up: $(STAMP)
	$(VENV)/bin/asyncinfer up $(if $(CONFIG),--config $(CONFIG))

test: test-unit lint typecheck buf-lint buf-breaking protos-check docs-check pytest pytest-nats-fallback

# The fast tier: the tests marked `unit` — pure domain logic (the job lifecycle's property tests,
# codecs, batching policy), no nats-server (tests/conftest.py refuses one to a unit test), seconds.
test-unit: $(STAMP)
	$(PYTEST) -q -m unit

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# Node.js runs buf (buf-lint, buf-breaking) and the Node client test (tests/test_node_client.py,
# which fails without it): Debian's nodejs and npm, installed here when missing and running as root.
$(NODE_STAMP): package.json package-lock.json
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq nodejs npm; \
		else echo "node and npm are missing (buf and the Node client test need them): run 'sudo apt-get install -y nodejs npm'"; exit 1; fi; \
	fi
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The project's own folders: a file a user saves beside them (a README snippet, try.py) is theirs.
PYTHON_DIRS = asyncinfer services tests bench scripts deploy

lint: $(STAMP)
	$(VENV)/bin/ruff check $(PYTHON_DIRS) pyproject.toml
	$(VENV)/bin/ruff format --check $(PYTHON_DIRS)

typecheck: $(STAMP)
	$(VENV)/bin/mypy asyncinfer services

buf-lint: $(NODE_STAMP)
	npx --no-install buf lint

# Against the previous commit, when it had the contract (a fresh clone of main has its history).
buf-breaking: $(NODE_STAMP)
	@if git rev-parse -q --verify HEAD~1 >/dev/null && git cat-file -e HEAD~1:buf.yaml 2>/dev/null; then \
		npx --no-install buf breaking --against '.git#ref=HEAD~1'; \
	else echo "buf breaking: no earlier contract to compare with"; fi

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

protos-check: $(STAMP)
	$(PY) scripts/gen_protos.py --check

# The configuration reference (docs/CONFIGURATION.md) and the TOML files the Kubernetes manifests
# mount (deploy/k8s, checked by tests/test_deploy_secrets.py) are generated from the typed config.
docs: $(STAMP)
	$(PY) scripts/gen_config_docs.py
	$(PY) deploy/k8s/generate_config.py

docs-check: $(STAMP)
	$(PY) scripts/gen_config_docs.py --check
	$(PY) deploy/k8s/generate_config.py --check

# The shells the completion tests source their scripts in (tests/test_cli_completion.py), the
# headless chromium the console's tests drive (tests/test_console.py), and promtool (Debian's
# prometheus package), which tests the alert rules (tests/test_deploy_metrics.py), installed here
# when missing and running as root; without them those tests fail rather than skip. The stamp is
# made only once all are there: with one missing, every `make test` says so again (it said it once).
SHELLS_STAMP := $(VENV)/.shells
$(SHELLS_STAMP): $(STAMP)
	@missing=0; for pair in zsh:zsh fish:fish chromium:chromium promtool:prometheus; do \
		tool=$${pair%%:*}; package=$${pair##*:}; \
		if ! command -v $$tool >/dev/null; then \
			if [ "$$(id -u)" = 0 ]; then apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $$package; \
			else echo "$$tool is missing (tests need it): run 'sudo apt-get install -y $$package'"; fi; \
			command -v $$tool >/dev/null || missing=1; \
		fi; \
	done; \
	if [ $$missing = 0 ]; then touch $@; fi

# Three workers (pytest-xdist), a test file each at a time: most of a test's time is waiting on its
# servers (run serially, 733 s of wall time for 430 CPU-s on 2 cores). Two at once took it from
# 718 s to 492 s (session 27); three from 642 s to 490 s with the machine quiet (session 37, 1,279
# tests, 147% of the 2 cores busy). Each test starts its own servers on free ports. A third worker
# first brought out two start-up failures under load, both fixed in the services (a scheduler's
# first heartbeat during an election, a stream placed before the cluster's third server joined).
# The longest files are handed out first (tests/file_order.py), so none is left to run alone at the end.
PYTEST_WORKERS ?= 3
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile

pytest: $(STAMP) $(NODE_STAMP) $(SHELLS_STAMP)
	$(PYTEST) -m "not unit" $(PYTEST_PARALLEL) --durations=25

# The NATS-heavy tests again with the NATS adapter's fast path off (asyncinfer/nats/_fastpath.py), so
# the public-API fallback a newer nats-py would get is tested too: the tests marked `nats_fallback`
# (requests and KV, the connect, the gateway's submit path and job records, retention, the scheduler,
# the crash test, whose services inherit the variable; of the scheduler's policies, those about held
# pulls, connections, restarts and dead letters: the others test policy, not the NATS calls under it,
# and were half this step's time). Test by test across the workers (none of these files shares a
# fixture across its tests), so no file's tests wait for another's. About a minute on 2 cores.
NATS_FALLBACK_TESTS := tests/test_nats_requests.py tests/test_shared.py tests/test_gateway.py \
	tests/test_gateway_lifecycle.py tests/test_retention.py tests/test_scheduler.py \
	tests/test_scheduler_policies.py tests/test_crash.py tests/test_blob_ranges.py

pytest-nats-fallback: $(STAMP) $(NODE_STAMP)
	ASYNCINFER_NATS_FASTPATH=0 $(PYTEST) -n $(PYTEST_WORKERS) --dist load -m nats_fallback $(NATS_FALLBACK_TESTS)

# The system benchmarks (about 20 minutes on 2 cores; run on an idle machine): every section, then
# bench/results/REPORT.md. QUICK=1 runs tiny sizes to check the scripts. The Celery reference needs
# Debian's redis-server, installed here when missing and running as root.
bench: $(STAMP)
	@if [ ! -x /usr/bin/redis-server ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
		else echo "redis-server is missing (the Celery reference needs it): run 'sudo apt-get install -y redis-server'"; fi; \
	fi
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m bench.system.run_all $(if $(QUICK),--quick)

# Batcher vs Triton (PyTriton) vs direct torch vs the gRPC ceiling (about 5 minutes; run on an idle machine).
bench-batcher: $(STAMP)
	$(PY) bench/batcher_bench.py

# The batcher on a CUDA GPU against PyTriton on the same GPU, under 10 minutes (bench/README.md);
# writes bench/results/gpu.md. Installs nothing: the GPU machine may be offline.
bench-gpu:
	PYTHON=$(PY) bench/gpu.sh

# WatchJob fan-out: gateway memory per watcher and change-to-message delay at 2,000 and 10,000
# concurrent watches (about 2 minutes); writes bench/results/watch.md.
bench-watch: $(STAMP)
	$(PY) bench/watch_bench.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
