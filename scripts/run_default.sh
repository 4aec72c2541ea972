#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh; HEADLOC_VENV names another) and run the main job: `headloc-harness` with no
# arguments = compressed-sensing localization on the embedded SmolLM2-135M-Instruct and
# the offline headloc_induction task. Results land in runs/locate/ (report.md,
# heads.json, heatmap.png). Rerunning continues an interrupted run; extra arguments go
# to `headloc-harness locate` (e.g. --force to start over).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${HEADLOC_VENV:-.venv}/bin/headloc-harness" locate "$@"
