# Two commands for a newcomer: `make run` and `make test` (see README.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test demo install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/agenteval bench workflow-trace-fidelity --workflow-trace examples/warn_partial_truth.json --subject example || test $$? -ne 1

test: install
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
