# Two set-up commands for a fresh machine (Python 3.10+, no torch needed):
#   make demo   installs into .venv and calibrates the embedded default (SmolLM2-135M-Instruct)
#   make test   installs into .venv (with test extras) and runs the test suite
# Inner loop, after `make test` has installed: make test-fast (leaves out tests marked slow)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast bench

demo:
	bash scripts/setup.sh
	HF_HUB_OFFLINE=1 $(BIN)/fisher-select calibrate --recipe recipes/rl-arithmetic-graded.yaml --out runs/demo --overwrite
	$(BIN)/fisher-select select runs/demo --top 0.01 --out runs/demo/mask.safetensors

test:
	bash scripts/setup.sh --test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -rs -n 2 --dist loadfile --durations=15

test-fast:
	[ -x $(BIN)/pytest ] || bash scripts/setup.sh --test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -rs -n 2 --dist loadfile --durations=15 -m "not slow"

bench:
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_engine.py
