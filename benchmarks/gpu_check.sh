#!/usr/bin/env bash
# One-call GPU check of the paged MLA decode kernel, for a machine lent an NVIDIA H200 for minutes.
#
# Run from the repo root (on the device machine, $OUT is the folder whose files come back):
#     bash benchmarks/gpu_check.sh "$OUT"
# Dry run on a machine without a GPU (tiny benchmark grid, the gpu tests skip):
#     CPU_OK=1 bash benchmarks/gpu_check.sh /tmp/gpu_check
#
# Steps, each under `timeout`, each cut to what is left of BUDGET_S (default 450 s, so the whole
# script ends inside 8 minutes); a failing step is recorded and the next one runs anyway:
#   1. env      (<= 90 s)  pick a Python whose jax sees the GPU: $PYTHON, .venv/bin/python,
#                          python3, /opt/torch/.venv/bin/python3 (the lent H200 image has jax 0.11
#                          with the CUDA 13 plugin and every runtime dep of this project under
#                          python3; it has no network, so nothing is pip-installed by default).
#                          The project is used from the tree via PYTHONPATH, not installed.
#                          Wheels in .whl/ (carried) are installed to /tmp/site first, if any.
#                          ALLOW_PIP=1 and no usable Python: make .venv with
#                          `pip install -e '.[test]' 'jax[cuda13]'` (needs a network).
#   2. nvidia-smi (<= 20 s) GPU, driver, clocks, memory in use.
#   3. pytest   (<= 150 s) `pytest -q -m gpu tests/kernels -x` with JAX_PLATFORMS=cuda: the
#                          compiled Triton kernel against the reference at the release dims.
#   4. speculation (<= 120 s) `python -m benchmarks speculative --only code --k 8 --prompts 3`:
#                          plain, n-gram, n-gram + corpus, draft model and lookup first on the
#                          built-in models (issue 15's goals).
#   5. bench    (the rest, >= 150 s) `python -m benchmarks kernel --only mla_decode --out OUTDIR`
#                          on the full grid (B 1 16 64, ctx 4096 32768, T 1 4), told to start no
#                          config within 60 s of its timeout; it rewrites
#                          OUTDIR/kernel_mla_decode.json after every config, so a cut-short run
#                          keeps its rows.
#   6. summary  OUTDIR/summary.txt: each step's exit code (124 = timed out) and seconds, the GPU,
#                          the pytest result line and both benchmark tables.
# Files in OUTDIR (8, the device tool's limit): env.log, nvidia-smi.log, pytest.log,
# speculation.log, speculative_code.json, bench.log, kernel_mla_decode.json, summary.txt.

set -u
set -o pipefail

if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/gpu_check.sh OUTDIR" >&2
    exit 2
fi
OUTDIR=$1
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.." || exit 2

CPU_OK=${CPU_OK:-0}
ALLOW_PIP=${ALLOW_PIP:-0}
BUDGET_S=${BUDGET_S:-450}
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
SUMMARY="$OUTDIR/summary.txt"
STEPS=""

export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $((DEADLINE - $(date +%s))); }

record() { # name rc seconds note
    STEPS+=$(printf '%-11s rc=%-4s %4ss  %s' "$1" "$2" "$3" "${4:-}")$'\n'
    printf '[gpu_check] %-11s rc=%-4s %4ss  %s\n' "$1" "$2" "$3" "${4:-}"
}

# run_step NAME CAP_S CMD...: run CMD under timeout min(CAP_S, time left - 5), output to NAME.log.
run_step() {
    local name=$1 cap=$2
    shift 2
    local t
    t=$(left)
    t=$((t - 5))
    [ "$cap" -lt "$t" ] && t=$cap
    if [ "$t" -lt 15 ]; then
        record "$name" skip 0 "no time left"
        return 0
    fi
    local s rc
    s=$(date +%s)
    timeout -k 5 "$t" "$@" >>"$OUTDIR/$name.log" 2>&1
    rc=$?
    local note=""
    [ "$rc" -eq 124 ] && note="timed out after ${t}s"
    record "$name" "$rc" $(($(date +%s) - s)) "$note"
    return 0
}

# ---- 1. env: pick the interpreter ------------------------------------------------------------
ENVLOG="$OUTDIR/env.log"
: >"$ENVLOG"
s=$(date +%s)
{
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cwd: $PWD"
    echo "CPU_OK=$CPU_OK ALLOW_PIP=$ALLOW_PIP BUDGET_S=$BUDGET_S"
    uname -a
    nproc
    free -g 2>/dev/null
} >>"$ENVLOG" 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
    echo "installing carried wheels from .whl/ to /tmp/site" >>"$ENVLOG"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$ENVLOG" 2>&1 &&
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

PROBE='import jax, sys; print(jax.default_backend(), jax.__version__, sys.version.split()[0])'
probe() { # interpreter -> prints "backend jax_version python_version" or nothing
    [ -n "$1" ] || return 1
    command -v "$1" >/dev/null 2>&1 || [ -x "$1" ] || return 1
    timeout -k 5 60 "$1" -c "$PROBE" 2>>"$ENVLOG" | tail -n 1
}

PY=""
PY_CPU=""
for cand in "${PYTHON:-}" .venv/bin/python python3 /opt/torch/.venv/bin/python3; do
    [ $(($(date +%s) - T0)) -lt 90 ] || break
    out=$(probe "$cand") || true
    [ -n "$out" ] || continue
    echo "candidate $cand: $out" >>"$ENVLOG"
    case "$out" in
    gpu*)
        PY=$cand
        break
        ;;
    *) [ -n "$PY_CPU" ] || PY_CPU=$cand ;;
    esac
done

if [ -z "$PY" ] && [ -z "$PY_CPU" ] && [ "$ALLOW_PIP" = 1 ]; then
    # Only with a network (the lent H200 has none). jax 0.10/0.11 name the CUDA extras cuda12
    # and cuda13; the H200 driver (580) runs CUDA 13.
    echo "no python with jax: making .venv with pip" >>"$ENVLOG"
    timeout -k 5 240 bash -c "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' \
        'jax[cuda13]'" >>"$ENVLOG" 2>&1
    out=$(probe .venv/bin/python) || true
    echo "candidate .venv/bin/python: $out" >>"$ENVLOG"
    case "$out" in
    gpu*) PY=.venv/bin/python ;;
    ?*) PY_CPU=.venv/bin/python ;;
    esac
fi

MODE=gpu
if [ -z "$PY" ]; then
    if [ "$CPU_OK" = 1 ] && [ -n "$PY_CPU" ]; then
        PY=$PY_CPU
        MODE=cpu
    else
        MODE=none
    fi
fi
env_rc=0
if [ -n "$PY" ]; then
    {
        echo "== using $PY (mode $MODE)"
        timeout -k 5 60 "$PY" - <<'EOF'
import importlib.metadata as md
import jax

print("jax", jax.__version__, "backend", jax.default_backend(), "devices", jax.devices())
for name in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "flax", "numpy"):
    try:
        print(f"pkg {name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
import kernels.mla_decode  # noqa: F401
import kimi_linear_jax.ops.mla  # noqa: F401

print("project imports: ok")
EOF
    } >>"$ENVLOG" 2>&1
    env_rc=$?
else
    echo "== no python whose jax sees a GPU (CPU_OK=1 accepts a CPU jax)" >>"$ENVLOG"
    env_rc=3
fi
record env "$env_rc" $(($(date +%s) - s)) "python=${PY:-none} mode=$MODE"

# ---- 2. nvidia-smi --------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    Q=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu
    run_step nvidia-smi 20 bash -c "nvidia-smi; nvidia-smi --format=csv --query-gpu=$Q,power.draw"
else
    echo "nvidia-smi: not found" >"$OUTDIR/nvidia-smi.log"
    record nvidia-smi 127 0 "not found"
fi

# ---- 3. correctness: the gpu-marked kernel tests ----------------------------------------------
if [ "$MODE" = gpu ]; then
    run_step pytest 150 env JAX_PLATFORMS=cuda "$PY" -m pytest -q -m gpu tests/kernels -x -rs \
        -p no:cacheprovider
elif [ "$MODE" = cpu ]; then
    # The same command on a CPU jax: collection and imports are checked, the gpu tests skip.
    run_step pytest 150 "$PY" -m pytest -q -m gpu tests/kernels -x -rs -p no:cacheprovider
else
    record pytest skip 0 "no usable python"
fi

# ---- 4. speculation on the built-in models (issue 15's speed goals) ---------------------------
if [ "$MODE" != none ]; then
    SPEC=(-m benchmarks speculative --only code --k 8 --prompts 3 --repeats 2 --out "$OUTDIR")
    [ "$MODE" = cpu ] && SPEC=(-m benchmarks speculative --only code --k 2 --prompts 1
        --max-tokens 16 --repeats 1 --lookup-k 2 --lookup-model-k 1 --out "$OUTDIR")
    run_step speculation 120 "$PY" "${SPEC[@]}"
else
    record speculation skip 0 "no usable python"
fi

# ---- 5. benchmark ---------------------------------------------------------------------------
if [ "$MODE" != none ]; then
    t=$(($(left) - 10))
    BENCH=(-m benchmarks kernel --only mla_decode --out "$OUTDIR"
        --time-budget $((t > 90 ? t - 60 : t / 2)))
    if [ "$MODE" = cpu ]; then
        BENCH+=(--B 1 --ctx 512 --T 1 4 --repeats 2 --copy-mib 64 --min-pool-mib 8)
    fi
    run_step bench "$t" "$PY" "${BENCH[@]}"
else
    record bench skip 0 "no usable python"
fi

# ---- 6. summary -----------------------------------------------------------------------------
{
    echo "gpu_check: mode=$MODE python=${PY:-none} total $(($(date +%s) - T0)) s" \
        "(budget $BUDGET_S s) $(date -u +%FT%TZ)"
    echo
    echo "steps (rc 124 = timed out):"
    printf '%s' "$STEPS"
    echo
    echo "gpu:"
    if grep -q '^name, driver_version' "$OUTDIR/nvidia-smi.log" 2>/dev/null; then
        grep -A1 '^name, driver_version' "$OUTDIR/nvidia-smi.log"
    else
        echo "(no nvidia-smi output)"
    fi
    grep -E '^(== using|jax |pkg |project imports)' "$ENVLOG" 2>/dev/null
    echo
    echo "pytest:"
    [ -f "$OUTDIR/pytest.log" ] && tail -n 5 "$OUTDIR/pytest.log"
    echo
    echo "speculation (code continuation, B = 1, greedy):"
    if [ -f "$OUTDIR/speculation.log" ]; then
        sed -n '/^ *config  *k /,/^wrote/p' "$OUTDIR/speculation.log"
        grep -E 'Error|Traceback' "$OUTDIR/speculation.log" | head -n 5
    fi
    echo
    echo "bench:"
    if [ -f "$OUTDIR/bench.log" ]; then
        grep -E '^(backend|copy bandwidth:)' "$OUTDIR/bench.log"
        if grep -qE '^ *B  *ctx  *T ' "$OUTDIR/bench.log"; then
            # The table: from its header line to the end.
            sed -n '/^ *B  *ctx  *T /,$p' "$OUTDIR/bench.log"
        else
            # Cut short: the configs that finished (their rows are in kernel_mla_decode.json).
            grep '^done:' "$OUTDIR/bench.log"
        fi
        grep -E 'Error|Traceback' "$OUTDIR/bench.log" | head -n 5
    fi
} >"$SUMMARY" 2>&1
cat "$SUMMARY"
exit 0
