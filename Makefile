# Two commands for a newcomer: `make run` and `make test` (see README.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test lint typecheck pyright demo install proto docs screenshots clean

INSTRUMENTATION := instrumentation/opentelemetry-instrumentation-maf-fidelity

# The instrumentation is installed as a wheel (its namespace package would make an editable install
# print setuptools' warning box), so it is reinstalled whenever one of its files changes. So is the
# compiled decoder (native/, needs Rust), whose wheel native/build.sh caches per version of its sources
# (offline, tools/native-wheel takes the wheelhouse's prebuilt one, which make wheelhouse files:
# docs/running.md "Offline / air-gapped install").
NATIVE := native/build.sh native/Cargo.toml native/Cargo.lock native/pyproject.toml $(shell find native/src -type f)
# tools/maf-venv builds every environment (.venv and each .venv-maf/ release) the same way.
INSTALL_INPUTS := pyproject.toml tools/maf-venv tools/offline.sh tools/native-wheel $(NATIVE) \
  $(shell find $(INSTRUMENTATION) -name '*.py' -o -name pyproject.toml | grep -v /build/)

# Microsoft Agent Framework releases tested, as core:orchestrations (docs/maf.md "Supported MAF releases").
# .venv (make install, make test) has MAF_DEFAULT, the newest tested release; pyproject's `test` extra
# pins the range they span. `make test-maf-matrix` runs MAF_TESTS on each MAF_MATRIX release in its
# own environment, .venv-maf/CORE+ORCH/; `make test-maf-latest` on the newest published.
MAF_DEFAULT := 1.26.0:1.4.0
MAF_MATRIX  := 1.22.0:1.3.2 1.23.0:1.4.0
# The tests that run real agent-framework code. test_maf_real_world.py is optional (run when present).
MAF_TESTS := tests/test_maf_patterns.py tests/test_maf.py tests/test_instrumentation.py tests/test_demo.py \
  tests/test_instrumentation_stacks.py tests/test_maf_unnamed.py $(wildcard tests/test_maf_real_world.py)

# pip runs quietly: one line first says what the silent minute is.
$(BIN)/.installed: $(INSTALL_INPUTS)
	@echo "installing agenteval, its test tools and MAF $(subst :, + orchestrations ,$(MAF_DEFAULT)) into $(VENV) (a minute or two, the first time only)..."
	PYTHON=$(PYTHON) tools/maf-venv $(VENV) $(subst :, ,$(MAF_DEFAULT))
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/agenteval collector serve

# The collector and the demo workflows together: the collector in the background, its output in a
# temporary log file (named first) so it stays out of the demo's table; the demo once it listens.
demo: install
	@log=$$(mktemp "$${TMPDIR:-/tmp}/agenteval-collector-XXXXXX"); echo "collector log: $$log"; \
	  $(BIN)/agenteval collector serve >"$$log" 2>&1 & pid=$$!; trap "kill $$pid 2>/dev/null; wait $$pid" EXIT; \
	  i=0; until grep -q "agenteval collector listening" "$$log"; do \
	    kill -0 $$pid 2>/dev/null || { echo "the collector did not start:"; cat "$$log"; \
	      echo "(a collector already running, e.g. make run? then run .venv/bin/agenteval demo)"; exit 1; }; \
	    i=$$((i + 1)); [ $$i -lt 300 ] || { echo "the collector is not listening after 30 s: see $$log"; exit 1; }; \
	    sleep 0.1; \
	  done; \
	  $(BIN)/agenteval demo

# Regenerate the committed gRPC code from proto/ (tests/test_proto.py checks it is current).
proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
	  proto/collector/api/v1/fidelity.proto

# Regenerate docs/configuration.md from config/collector.yaml (tests/test_docs.py checks it is current).
docs:
	$(PYTHON) tools/config_docs.py

# Refresh docs/run-page-*.png from the browser tests (needs Debian's chromium).
screenshots: install
	AGENTEVAL_SCREENSHOTS=docs AGENTEVAL_REQUIRE_BROWSER=1 $(BIN)/pytest -q tests/test_run_page.py

# The type checker, pyright (pyproject.toml [tool.pyright]), pinned in tools/pyright/package-lock.json and
# installed with npm once per lock file. `make test` runs it first; `make test TYPECHECK=` leaves it out
# (.ci/run, where npm or its registry is missing).
PYRIGHT_DIR := tools/pyright
TYPECHECK := typecheck

$(PYRIGHT_DIR)/node_modules/.installed: $(PYRIGHT_DIR)/package.json $(PYRIGHT_DIR)/package-lock.json
	@command -v npm >/dev/null || { echo "npm is not installed: make typecheck needs Node.js (make test TYPECHECK= leaves it out)"; exit 1; }
	cd $(PYRIGHT_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

pyright: $(PYRIGHT_DIR)/node_modules/.installed

# Fails on any error; reads .venv for the dependencies' types.
typecheck: install pyright
	$(PYRIGHT_DIR)/node_modules/.bin/pyright

# The linter, ruff (pyproject.toml [tool.ruff]), pinned in pyproject's test extra and so installed by
# `make install`. `make test` runs it first, always; a rule that does not fit a file is left out in
# [tool.ruff.lint.per-file-ignores], with why, never in a noqa comment (tests/test_habits.py).
lint: install
	$(BIN)/ruff check .

# --durations: the slowest tests are named in every run's output (CI's too), where a slow part shows first.
test: install lint $(TYPECHECK)
	$(BIN)/pytest --durations=15

# One MAF release: make test-maf MAF=1.23.0 ORCH=1.4.0 (an environment per release, kept until its
# inputs change). The pytest run fails on exit 5 too: these files always hold tests.
.PHONY: test-maf test-maf-matrix test-maf-latest
test-maf:
	@[ -n "$(MAF)" ] && [ -n "$(ORCH)" ] || { echo "usage: make test-maf MAF=1.23.0 ORCH=1.4.0 (agent-framework-core, -orchestrations)"; exit 2; }
	$(MAKE) --no-print-directory .venv-maf/$(MAF)+$(ORCH)/.installed
	.venv-maf/$(MAF)+$(ORCH)/bin/pytest -p no:cacheprovider $(MAF_TESTS)

.venv-maf/%/.installed: $(INSTALL_INPUTS)
	PYTHON=$(PYTHON) tools/maf-venv $(@D) $(subst +, ,$*)
	touch $@

# Every MAF_MATRIX release, each whatever the others did; fails if any failed.
test-maf-matrix:
	@failed=""; for release in $(MAF_MATRIX); do \
	  echo "== agent-framework-core:orchestrations $$release"; \
	  $(MAKE) --no-print-directory test-maf MAF=$${release%%:*} ORCH=$${release##*:} || failed="$$failed $$release"; \
	done; \
	[ -z "$$failed" ] || { echo "MAF releases that failed:$$failed"; exit 1; }

# The newest core and orchestrations published, upgraded on every call: try a new MAF the day it ships.
test-maf-latest: .venv-maf/latest/.installed
	.venv-maf/latest/bin/pip install --quiet --upgrade agent-framework-core agent-framework-orchestrations
	@.venv-maf/latest/bin/pip show agent-framework-core agent-framework-orchestrations | grep -E '^(Name|Version):' | paste - -
	.venv-maf/latest/bin/pytest -p no:cacheprovider $(MAF_TESTS)

# The .NET ledger package (instrumentation/dotnet, docs/dotnet.md): its xunit tests on each MAF .NET
# release tested (the newest and the oldest the NuGet copy restores), then its NuGet package, into
# dist/ (as make dist). The real-workflow scenarios run in `make test`
# (tests/test_dotnet_live.py), against a live collector.
MAF_DOTNET := 1.28.0 1.20.0
# The package is built against the oldest, so it asks for no newer MAF than its users have.
MAF_DOTNET_OLDEST := $(lastword $(MAF_DOTNET))
DOTNET_DIR := instrumentation/dotnet
DOTNET_PACK := dotnet pack $(DOTNET_DIR)/src/AgentEval.Instrumentation.MafFidelity -c Release \
  -p:MafVersion=$(MAF_DOTNET_OLDEST) --nologo -o dist
.PHONY: test-dotnet
test-dotnet:
	@for release in $(MAF_DOTNET); do \
	  echo "== Microsoft.Agents.AI.Workflows $$release"; \
	  dotnet test $(DOTNET_DIR)/MafFidelity.sln -p:MafVersion=$$release --nologo || exit 1; \
	done
	$(DOTNET_PACK)

# The release artifacts an app outside this repository installs the ledger from (docs/maf.md,
# docs/dotnet.md; neither package is on a public index): the collector's and the MAF
# instrumentation's wheels and, where the .NET SDK is, the .NET ledger package, into dist/.
.PHONY: dist
dist:
	mkdir -p dist
	bash -c 'source tools/offline.sh && agenteval_offline $(PYTHON) && \
	  $(PYTHON) -m pip wheel --quiet --no-deps --wheel-dir dist . ./$(INSTRUMENTATION)'
	@if command -v dotnet >/dev/null; then $(DOTNET_PACK); \
	  else echo "note: no .NET SDK: dist/ has no AgentEval.Instrumentation.MafFidelity package"; fi

# The wheelhouse a machine with no Python package index installs from (docs/running.md "Offline /
# air-gapped install"), built where PyPI, crates.io and Rust are: every wheel make install, make test
# and make test-maf-matrix install, and the compiled decoder of today's native/. By default where
# tools/offline.sh looks for it ($AGENTEVAL_WHEELHOUSE, else ../shared/wheelhouse-py311); elsewhere:
# make wheelhouse WHEELHOUSE=DIR.
WHEELHOUSE ?=
.PHONY: wheelhouse
wheelhouse:
	PYTHON=$(PYTHON) tools/make_wheelhouse.sh $(WHEELHOUSE)

clean:
	rm -rf $(VENV) .venv-maf .pytest_cache .ruff_cache .hypothesis dist $(DOTNET_DIR)/bin $(DOTNET_DIR)/obj $(PYRIGHT_DIR)/node_modules

# Peers + throughput, this tree beside the collector of commit BASE (each in its own venv; BASE's
# built once by bench/base.sh), alternating in one sitting, with the ratios: make bench-check BASE=8fe69c1.
# Minutes, not part of `make test`. rotel (bench/peers.py's Rust peer) is pinned here.
ROTEL := rotel==0.0.1a15
BENCH_TRACES ?= 2000
BENCH_ROUNDS ?= 3
.PHONY: bench-check
bench-check: install
	@[ -n "$(BASE)" ] || { echo "usage: make bench-check BASE=<commit> [BENCH_TRACES=2000] [BENCH_ROUNDS=3]"; exit 2; }
	@$(BIN)/pip install --quiet "$(ROTEL)"
	@base=$$(bench/base.sh $(BASE)) && set -x && \
	  $(BIN)/python bench/peers.py --code . $$base --streams 1 16 --runs $(BENCH_ROUNDS) --traces $(BENCH_TRACES) && \
	  $(BIN)/python bench/throughput.py --code . $$base --streams 1 16 --rounds $(BENCH_ROUNDS) --traces $(BENCH_TRACES)

.PHONY: otelcol scaleout helm kafka

# Our OpenTelemetry Collector distribution (otelcol/manifest.yaml, built with ocb; needs Go): built
# once into ~/.cache/agenteval/otelcol/<manifest sha256>/ and reused while the manifest is unchanged.
# tests/test_scaleout.py runs it (and skips, naming this target, when it is missing).
otelcol:
	@otelcol/build.sh

# helm (v3, pinned in deploy/helm/helm.sh; needs Go), built from the Go module proxy once into
# ~/.cache/agenteval/helm/<version>/: tests/test_deploy.py renders the chart with it (and skips,
# naming this target, when it is missing).
helm:
	@deploy/helm/helm.sh

# Apache Kafka (tools/kafka/pom.xml: kafka_2.13 and kafka-tools from Maven Central; needs Java 17+ and
# Maven): resolved once into ~/.cache/agenteval/kafka/<pom.xml sha256>/libs. tests/test_kafka.py runs
# the broker from there in KRaft mode (and skips, naming this target, when it is missing).
kafka:
	@tools/kafka/kafka.sh

# The scaled-out topology without docker: a throwaway PostgreSQL, two replicas, the load balancer.
scaleout: install otelcol
	otelcol/run-local.sh
