PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export MASTER_ADDR := 127.0.0.1
export GLOO_SOCKET_IFNAME := lo
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup run test lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]' --no-deps
	$(BIN)/pip install -e '.' 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'transformers>=5.17,<6' 'openai>=1.40' 'ruff>=0.6' 'httpx>=0.27' py-cpuinfo pydantic ninja hjson msgpack psutil einops
	DS_BUILD_OPS=0 $(BIN)/pip install --no-build-isolation 'deepspeed>=0.16'
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python -m launch demo

test: setup
	$(BIN)/ruff check moe parallel balancer launch tests
	$(BIN)/python -m pytest -q -x --durations=15

lint: setup
	$(BIN)/ruff check moe parallel balancer launch tests

clean:
	rm -rf $(VENV) .pytest_cache
