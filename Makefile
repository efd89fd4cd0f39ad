VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-slow wheel-check bench-quick

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

# Speculative generation on the embedded default (SmolLM2-135M-Instruct + bundled drafter).
demo: setup
	$(VENV)/bin/eagle-jax generate --prompt "Write a Python function that checks whether a number is prime." --max-new-tokens 128 --disable-by-batch-size none

# The test suite CI runs (heavy cases are marked `slow` and excluded).
# --max-worker-restart=0: under --dist loadfile, pytest-xdist 3.8 can wait forever after it
# replaces a crashed worker (pytest-xdist#784); a crash must fail the run at once, naming the test.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0

# The package as a user installs it: a wheel in a fresh venv without PyTorch (scripts/wheel_check.sh).
wheel-check: setup
	PYTHON=$(PY) bash scripts/wheel_check.sh

test-slow: setup
	$(PY) -m pytest -q -m slow -n 2 --dist loadfile --max-worker-restart=0

bench-quick: setup
	$(VENV)/bin/eagle-jax bench --quick
