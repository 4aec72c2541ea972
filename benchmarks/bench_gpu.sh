#!/usr/bin/env bash
# The GPU benchmarks at the sizes users run: a random-weight Llama-3.2-1B and Llama-3.1-8B
# in bfloat16 (benchmarks/bench_measure.py --config; headloc_bench/bench_scale.py says what
# is measured).
#
#   bash benchmarks/bench_gpu.sh 1b|8b|gen1b|gen8b|first1b|ratio|all [OUT_DIR]
#
# gen1b and gen8b time a generation task's measurement at K masks per generate call and a
# whole generating locate (benchmarks/bench_generation.py). first1b times a first run
# against a later one at 1B (benchmarks/bench_first_run.py); ratio, at 1B and 8B, only the
# automatic K against the bare generate (at 1B its call taken apart). first1b on a freshly
# started machine, then ratio, take about 8 minutes together on an H200 (estimated from the
# stages' earlier parts): the short pass; ratio's sections replace gen1b's and gen8b's.
# Each stage writes its section into OUT_DIR/BENCH.md (a copy of this BENCH.md; default:
# this BENCH.md itself) and its log into OUT_DIR/bench-<stage>.log. Run on another GPU
# machine (docs/development.md, "Benchmarks on a GPU") with an empty OUT_DIR, then bring
# its new sections into this BENCH.md:
#   python benchmarks/bench_sections.py copy OUT_DIR/BENCH.md BENCH.md
# With .whl/ present (scripts/gpu_wheels.sh), the wheels are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."

stage="${1:-}"
out="${2:-}"
case "$stage" in
    1b|8b|gen1b|gen8b|first1b|ratio|all) ;;
    *) echo "bench_gpu.sh: stage '$stage': expected 1b, 8b, gen1b, gen8b, first1b, ratio or all" >&2
       exit 2 ;;
esac
if [ -n "$out" ]; then
    [ -d "$out" ] || { echo "bench_gpu.sh: OUT_DIR '$out' is not a folder" >&2; exit 2; }
    # Never over what is not ours: an OUT_DIR already holding these files is refused.
    for name in BENCH.md bench-1b.log bench-8b.log bench-gen1b.log bench-gen8b.log \
            bench-first1b.log bench-stops.log bench-ratio1b.log bench-ratio8b.log; do
        [ ! -e "$out/$name" ] || { echo "bench_gpu.sh: '$out/$name' exists; name an empty OUT_DIR" >&2; exit 2; }
    done
    cp BENCH.md "$out/BENCH.md"
    bench="$out/BENCH.md" logs="$out"
else
    bench=BENCH.md logs=.
fi

python="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    bash scripts/gpu_wheels.sh install >/dev/null
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    python=python3
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$python" -c 'import torch, sys; torch.cuda.is_available() or sys.exit("bench_gpu.sh: no CUDA device")'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

run() {  # stage, the benchmark's entry point in benchmarks/, then its options
    local name="$1" script="$2"
    shift 2
    set -o pipefail
    # --out before the options: bench_first_run.py's end with `-- <locate arguments>`.
    "$python" "benchmarks/$script" --device cuda --dtype bfloat16 --out "$bench" "$@" \
        2>&1 | tee "$logs/bench-$name.log"
}

# A first run against a later one, first on a freshly started machine (its file cache empty
# of the libraries and the model); capped at the default run's measurements before its
# group tests: what a first run adds does not depend on how many it measures. Carried
# wheels should be whole (scripts/gpu_wheels.sh --no-slim): a first run indexes lm-eval's
# ~14,000 task configs, which the slimmed wheel leaves out (the section says how many).
if [ "$stage" = first1b ] || [ "$stage" = all ]; then
    run first1b bench_first_run.py --config llama-3.2-1b --task scale_choice -- \
        --max-measurements 54
fi

# Sized so that each stage ends within 10 minutes on one H100 or H200 (the timings are in
# docs/development.md, "Benchmarks on a GPU"): the generation task's measurements are ~40 s
# each at 8B (~20 s at 1B), so they are repeated less, and the generating locate is not run
# but derived from the logprob run's fixed part and one measurement's seconds (on an H100,
# where the 1B stage also ran it, the derivation came out 30 % above the measured run); the
# 8B's masks-per-pass sweep doubles K up to 16 (the automatic K is measured wherever it
# lies) and times 4 masks per K beyond the warm-up. On that H100 the 8B stage took 469 s and
# the 1B stage, with its generating locate, about 390 s; without it the 1B stage has room
# to time its generating measurement twice (once, it came out 1.32x the limit while the
# locate's own generating measurements took less than the limit). On an H200 the 8B stage
# took 492 s and the 1B stage was stopped ~30 s before its end, so the 1B stage now stops
# its sweep at K = 32 (K = 1 to 64 were within 6 % there) and times the reference's
# generation on one document.
if [ "$stage" = 1b ] || [ "$stage" = all ]; then
    run 1b bench_measure.py --config llama-3.2-1b --repeats 5 --gen-repeats 2 --reference-repeats 1 \
        --reference-gen-docs 1 --sweep-masks 8 --max-masks-per-pass 32 --locate choice gen:logprob
fi
if [ "$stage" = 8b ] || [ "$stage" = all ]; then
    run 8b bench_measure.py --config llama-3.1-8b --repeats 3 --gen-repeats 1 --reference-repeats 1 \
        --reference-gen-docs 1 --sweep-masks 4 --max-masks-per-pass 16 \
        --locate choice gen:logprob
fi
# Generation at K masks per generate call (bench_generation.py): K = 1, 4, 8 and the
# automatic K on the gsm8k-shaped task, the bare generate of the same calls at K = 1 and the
# automatic K, at 1B the automatic K's largest call taken apart for its first 16 steps
# (bare, with the knockout, with the row stops, ours: 12 runs, each with the call's whole
# prompts' pass: 3,700 rows of ~250 tokens at 1B, about 2.4 PFLOP; 1,500 rows at 8B, about
# 6 PFLOP, where the 12 runs would take 2-3 minutes more than the stage has), then a whole
# locate in a process of its own, capped at the default run's 54 measurements before its group tests (a
# certified run of 512 or 1,024 random heads would spend up to half an evaluation per head;
# 47 measurements took 225 s at 8B, timed out at 300 s so that the stage, 481 s with a
# 330 s timeout, ends within 10 minutes).
if [ "$stage" = gen8b ] || [ "$stage" = all ]; then
    run gen8b bench_generation.py --config llama-3.1-8b --ks 4,8 --locate \
        --locate-timeout 300 --locate-max-measurements 54
fi
if [ "$stage" = gen1b ] || [ "$stage" = all ]; then
    run gen1b bench_generation.py --config llama-3.2-1b --ks 4,8,16 --step-profile 16 --locate \
        --locate-timeout 240 --locate-max-measurements 54
fi
# Only the ratio to the bare generate, at both sizes: K = 1 and the automatic K (its bare
# generate timed), at 1B its largest call taken apart for 16 steps; no sweep, no locate
# (estimated from the 2026-11-27 stages' parts: about 3 minutes each); first the row stops'
# cost a step at those calls' rows, with the ids on the GPU (bench_stop_checks.py, ~10 s).
if [ "$stage" = ratio ]; then
    "$python" benchmarks/bench_stop_checks.py --device cuda --rows 1500,3700 --out "$bench" \
        2>&1 | tee "$logs/bench-stops.log"
    run ratio1b bench_generation.py --config llama-3.2-1b --ks "" --bare auto --step-profile 16
    run ratio8b bench_generation.py --config llama-3.1-8b --ks "" --bare auto
fi
