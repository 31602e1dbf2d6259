# Two commands for a newcomer: `make run` and `make test` (see README.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test demo install proto screenshots clean

INSTRUMENTATION := instrumentation/opentelemetry-instrumentation-maf-fidelity

# The instrumentation is installed as a wheel (its namespace package would make an editable install
# print setuptools' warning box), so it is reinstalled whenever one of its files changes. So is the
# compiled decoder (native/, needs Rust), whose wheel native/build.sh caches per version of its sources.
NATIVE := native/build.sh native/Cargo.toml native/Cargo.lock native/pyproject.toml $(shell find native/src -type f)
$(BIN)/.installed: pyproject.toml $(shell find $(INSTRUMENTATION) -name '*.py' -o -name pyproject.toml | grep -v /build/) $(NATIVE)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet ./$(INSTRUMENTATION) -e '.[test]'
	if command -v cargo >/dev/null || [ -x "$$HOME/.cargo/bin/cargo" ]; then \
	  wheel=$$(native/build.sh $(BIN)/python) && $(BIN)/pip install --quiet --force-reinstall --no-deps "$$wheel"; \
	else \
	  echo "note: no Rust (cargo): the collector decodes protobuf in Python, several times slower per span (native/README.md)"; \
	fi
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

# Refresh docs/run-page-*.png from the browser tests (needs Debian's chromium).
screenshots: install
	AGENTEVAL_SCREENSHOTS=docs AGENTEVAL_REQUIRE_BROWSER=1 $(BIN)/pytest -q tests/test_run_page.py

test: install
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

.PHONY: otelcol scaleout

# Our OpenTelemetry Collector distribution (otelcol/manifest.yaml, built with ocb; needs Go): built
# once into ~/.cache/agenteval/otelcol/<manifest sha256>/ and reused while the manifest is unchanged.
# tests/test_scaleout.py runs it (and skips, naming this target, when it is missing).
otelcol:
	@otelcol/build.sh

# The scaled-out topology without docker: a throwaway PostgreSQL, two replicas, the load balancer.
scaleout: install otelcol
	otelcol/run-local.sh
