# The README's commands. `make run` and `make test` install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without an NVIDIA GPU, take a CPU build of torch (this pin installs from the machine's local
# wheel); set TORCH_CPU_INDEX="--index-url https://download.pytorch.org/whl/cpu" where PyPI's
# default would be a CUDA build. With a GPU, pip picks a CUDA build within pyproject's range.
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?=
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: install run generate test test-slow soak lint bench bench-serve gpu-wheels gpu-dry-run clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
ifneq ($(HAS_GPU),yes)
	$(BIN)/pip install $(TORCH_CPU_INDEX) "$(TORCH_CPU_SPEC)"
endif
	$(BIN)/pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/kvserve serve

generate: install
	$(BIN)/kvserve generate

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q

# The tests marked slow (cold C++ builds, start-ups killed in every phase, Triton over quantized checkpoints:
# about 7 minutes); CI runs them too.
test-slow: install
	$(BIN)/pytest -q -m slow

# Constant mixed load against a `kvserve serve` process (10 minutes; SOAK_ARGS="--duration-s 60" for less).
soak: install
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python -m benchmarks.offline_throughput

bench-serve: install
	$(BIN)/python -m benchmarks.serve_bench

# The wheels benchmarks/gpu_check.sh carries to the GPU machine (gpu_wheels/), and the check's dry run on this CPU with
# only what the GPU image has plus those wheels (CI runs it after the tests; about 3 minutes).
gpu-wheels: install
	PYTHON=$(BIN)/python bash benchmarks/gpu_wheels.sh

# The dry run takes the same wheels built for this venv's Python (the GPU image's is 3.12).
gpu-dry-run: install
	PYTHON=$(BIN)/python TARGET_PYTHON=$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
		bash benchmarks/gpu_wheels.sh gpu_check_out/wheels
	PYTHON=$(BIN)/python GPU_WHEELS=gpu_check_out/wheels OUT=$${OUT:-gpu_check_out} bash benchmarks/gpu_check.sh --dry-run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis gpu_wheels gpu_check_out
