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
	$(BIN)/agenteval collector serve

# The collector and the demo workflows together: collector in the background, demo in front.
demo: install
	@$(BIN)/agenteval collector serve & pid=$$!; trap "kill $$pid 2>/dev/null; wait $$pid" EXIT; \
	  sleep 3; $(BIN)/agenteval demo

test: install
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
