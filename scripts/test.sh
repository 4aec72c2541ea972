#!/usr/bin/env bash
# Set up .venv with the test extras (scripts/setup.sh --test; HEADLOC_VENV names another)
# and run the whole test suite, slow tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the fast ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${HEADLOC_VENV:-.venv}/bin/python" -m pytest -q --durations=15 "$@"
