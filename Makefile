# `make run`: set everything up and serve the demo; `make test`: set up and run the suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export MASTER_ADDR := 127.0.0.1
export GLOO_SOCKET_IFNAME := lo
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup run test test-fast lint clean

# Order matters: the CPU torch wheel first (a looser spec pulls a multi-GB CUDA build), then
# DeepSpeed built against it without build isolation, then the project with its test extra.
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install packaging numpy py-cpuinfo psutil ninja hjson msgpack pydantic einops
	DS_BUILD_OPS=0 $(BIN)/pip install --no-build-isolation 'deepspeed>=0.16'
	$(BIN)/pip install -e '.[test]'
	$(BIN)/python -m launch build-kernels || echo "CPU expert kernel not built: the PyTorch path will run"
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python -m launch demo

# The kernel must build here (gcc is on these machines): without it the kernel tests would skip and the
# suite pass on the PyTorch path alone. `build-kernels` exits 1 with the compiler's first error.
test: setup
	$(BIN)/ruff check moe parallel balancer launch tests
	$(BIN)/python -m launch build-kernels
	$(BIN)/python -m pytest -q --durations=20

# The inner loop (about a minute): everything but the tests marked slow (engines, ranks, Ray, benchmarks).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check moe parallel balancer launch tests

clean:
	rm -rf $(VENV) .pytest_cache
