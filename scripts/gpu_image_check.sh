#!/usr/bin/env bash
# Rehearse a GPU machine without network here, on the CPU, before the GPU benchmarks start:
# a venv shaped like that machine (docs/development.md, "On a GPU machine without network":
# torch and its other packages at the versions given there, nothing of ours), the wheels
# scripts/gpu_wheels.sh carries (fetched for this Python), a copy of the committed tree
# (what is copied to the GPU machine, less the ignored files), then the same install step
# and a toy run of the benchmark bench_gpu.sh runs there. A package the carried wheels
# miss, or an import that machine's versions break, fails here with its own error.
#
#   bash scripts/gpu_image_check.sh [WORK_DIR]    (default: a new temporary folder)
#
# Differences that remain: Python 3.11 here (3.12 there; the wheels are fetched for
# 3.11), numpy < 2.5 (2.5 needs 3.12), torch 2.13 CPU (2.11 CUDA there).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work="${1:-$(mktemp -d /tmp/gpu-image-check.XXXXXX)}"
[ -d "$work" ] || { echo "gpu_image_check.sh: '$work' is not a folder" >&2; exit 2; }
[ -z "$(ls -A "$work")" ] || { echo "gpu_image_check.sh: '$work' is not empty; name an empty folder" >&2; exit 2; }
python="${PYTHON:-python3}"

echo "== the GPU machine's packages, in $work/venv"
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "torch==2.13.0"
# The GPU machine's versions (transformers 5.17: older than ours, replaced by the carried
# wheel); the rest at their newest, where no version is given.
"${pip[@]}" install "numpy<2.5" "huggingface_hub==1.33.0" "tokenizers==0.23.2" \
    "safetensors==0.8.0" "accelerate==1.15.0" "transformers==5.17.0" peft pandas pyarrow \
    fsspec scikit-learn scipy sacrebleu pyyaml jinja2 tqdm requests regex psutil xxhash \
    aiohttp matplotlib filelock packaging tabulate colorama portalocker lxml

echo "== the carried wheels, for this Python"
GPU_WHEELS_DIR="$work/whl" GPU_WHEELS_PYTHON=3.11 bash scripts/gpu_wheels.sh >/dev/null

echo "== the repository as copied to the GPU machine, with the wheels"
mkdir "$work/tree"
git archive HEAD | tar -x -C "$work/tree"
mkdir "$work/tree/.whl"
cp "$work/whl/"*.whl "$work/tree/.whl/"

cd "$work/tree"
clean=(env -i "HOME=$HOME" "PATH=$work/venv/bin:/usr/bin:/bin" HF_HUB_OFFLINE=1
       HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false)
echo "== the install step (gpu_wheels.sh install)"
"${clean[@]}" GPU_SITE="$work/site" GPU_WHEELS_PYTHON=3.11 bash scripts/gpu_wheels.sh install
echo "== the benchmark, a toy shape on the CPU"
cp BENCH.md "$work/BENCH.md"
"${clean[@]}" PYTHONPATH="$work/site:$work/tree" python3 benchmarks/bench_measure.py \
    --config tiny-llama --device cpu --dtype float32 --num-samples 4 --repeats 1 \
    --reference-repeats 1 --reference-gen-docs 2 --max-gen-toks 4 --max-masks-per-pass 2 \
    --sweep-masks 2 --batch-size 2 --out "$work/BENCH.md" > "$work/bench.log" 2>&1 \
    || { tail -30 "$work/bench.log" >&2; echo "gpu_image_check.sh: the benchmark failed (log: $work/bench.log)" >&2; exit 1; }
grep -q "<!-- bench_measure tiny-llama: start -->" "$work/BENCH.md" \
    || { echo "gpu_image_check.sh: the benchmark wrote no section into $work/BENCH.md" >&2; exit 1; }
echo "== the generation benchmark (bench_gpu.sh gen8b/gen1b), a toy shape on the CPU"
"${clean[@]}" PYTHONPATH="$work/site:$work/tree" python3 benchmarks/bench_generation.py \
    --config tiny-llama --device cpu --num-samples 4 --max-gen-toks 4 --ks 2 --locate \
    --out "$work/BENCH.md" > "$work/bench-gen.log" 2>&1 \
    || { tail -30 "$work/bench-gen.log" >&2; echo "gpu_image_check.sh: the generation benchmark failed (log: $work/bench-gen.log)" >&2; exit 1; }
grep -q "<!-- bench_generation tiny-llama: start -->" "$work/BENCH.md" && grep -q "^| 2 | " "$work/BENCH.md" \
    && ! grep -q "it failed" "$work/BENCH.md" \
    || { echo "gpu_image_check.sh: the generation benchmark's section is missing or says a failure ($work/BENCH.md)" >&2; exit 1; }
echo "== the first-run benchmark (bench_gpu.sh first1b), a toy shape on the CPU"
"${clean[@]}" PYTHONPATH="$work/site:$work/tree" python3 benchmarks/bench_first_run.py \
    --config tiny-llama --task scale_choice --dtype float32 --out "$work/BENCH.md" \
    -- --max-measurements 54 > "$work/bench-first.log" 2>&1 \
    || { tail -30 "$work/bench-first.log" >&2; echo "gpu_image_check.sh: the first-run benchmark failed (log: $work/bench-first.log)" >&2; exit 1; }
# BENCH.md already holds a "first run" section: the new one names the toy shape's command.
awk '/<!-- first run: start -->/,/<!-- first run: end -->/' "$work/BENCH.md" \
    | grep -q -- "--config tiny-llama --task scale_choice" \
    || { echo "gpu_image_check.sh: the first-run benchmark wrote no section into $work/BENCH.md" >&2; exit 1; }
cd "$root"
echo "ok: the GPU machine's packages + the carried wheels install, import and run the benchmark ($work)"
