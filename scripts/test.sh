#!/usr/bin/env bash
# Set up .venv with the test extras (scripts/setup.sh --test; HEADLOC_VENV names another)
# and run the whole test suite, slow tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the fast ones.
# The tests run in a worker process per core, at most 4 (pytest-xdist), each test file in
# one worker (its module fixtures made once), files handed out in the order collected
# (tests/conftest.py puts the slow ones first); `scripts/test.sh -n 0` runs them in one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${HEADLOC_VENV:-.venv}/bin/python" -m pytest -q --durations=15 \
    -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@"
