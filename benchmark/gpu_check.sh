#!/usr/bin/env bash
# The GPU check of ppo_atari_multigpu.py, for a lent GPU machine (one H200 or H100), in at most
# 7 minutes of its own wall clock (a 15-minute lease less the machine's start):
#   bash benchmark/gpu_check.sh OUT_DIR [--cpu-dry-run]
# A device call carries the wheels (carry: [".whl"], made by benchmark/fetch_gpu_wheels.sh) and
# runs `bash benchmark/gpu_check.sh $OUT`.
# Step 0 (here): install the carried wheels into /tmp/site when .whl/ exists, else use the
# current environment. Steps 1-5 (benchmark/gpu_check.py), most wanted first: preflight, trainer
# rows (1x8; 2 ranks on the one GPU, gloo, native+bf16+compile; 1x8 compile, compile+graphs),
# env-stepping ceiling, update ceiling, the table. Each step has a cap (gpu_check.py's GPU_STEPS,
# summed under the limit by tests/test_gpu_check.py). Every step appends its section to
# OUT_DIR/summary.md and writes its log as soon as it ends, so a run cut short keeps what it
# measured; the line under the header names the torch, CUDA, driver and GPU it ran on. Exit: 0
# every step ok, 1 some step failed, 124 the overall limit stopped it.
# --cpu-dry-run: the same steps on CPU with tiny sizes (2-3 minutes on 2 shared cores), so the
# script cannot rot.
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS (default <repo>/.whl), GPU_CHECK_SITE
# (default /tmp/site), GPU_CHECK_TOTAL_S (overall limit, default and at most 420 s).
set -u

usage() {
    echo "usage: bash benchmark/gpu_check.sh OUT_DIR [--cpu-dry-run]" >&2
    exit 2
}
[ $# -ge 1 ] && [ $# -le 2 ] || usage
case "$1" in -*) usage ;; esac
OUT=$1
DRY=()
if [ $# -eq 2 ]; then
    [ "$2" = --cpu-dry-run ] || usage
    DRY=(--cpu-dry-run)
fi

START=$(date +%s)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
TOTAL_S=${GPU_CHECK_TOTAL_S:-420}
[ "$TOTAL_S" -le 420 ] 2>/dev/null || TOTAL_S=420 # 420 s + 10 s to be killed: 7 min 10 s at most
WHEELS_S=20                                        # gpu_check.py's GPU_STEPS cap of "wheels"

mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
# a fresh folder's worth: no file of an earlier run may pass for this one's
rm -f "$OUT"/{summary.md,results.json,preflight.log} \
  "$OUT"/{env-ceiling.log,update-ceiling.log,trainer-rows.log}
SUMMARY=$OUT/summary.md
{
    echo "# GPU check of ppo_atari_multigpu.py"
    echo
    mode='GPU run'
    [ ${#DRY[@]} -gt 0 ] && mode='CPU dry run (tiny sizes: exercises every step; no GPU figure)'
    echo "- mode: $mode"
    echo "- started: $(date '+%Y-%m-%d %H:%M:%S %Z'), host $(hostname), overall limit ${TOTAL_S} s"
    if commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null); then
        git -C "$REPO" diff --quiet HEAD -- 2>/dev/null || commit+=" (with uncommitted changes)"
    fi
    echo "- commit: ${commit:-unknown (no git here)}"
    echo "- command: \`bash benchmark/gpu_check.sh $*\`"
    # gpu_check.py's preflight puts the versions in this line's place
    echo "- torch / CUDA / driver / GPU: unknown (the preflight step did not report)"
} >"$SUMMARY"

# ---- step 0: wheels (the GPU image lacks gymnasium, ale-py, tyro and a few of their needs) ----
{
    echo
    echo "## 0. Wheels"
    echo
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
        other=$(cd "$WHEELS" && ls -- *-cp3*.whl 2>/dev/null | grep -v -- "-$tag-" | head -1)
        if [ -n "$other" ]; then
            echo "- skipped: \`$other\` is not for this interpreter (${tag:-no python}):" \
                "the current environment's packages are used"
        elif timeout "$WHEELS_S" "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl >>"$OUT/preflight.log" 2>&1
        then
            export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
            names=$(cd "$WHEELS" && ls -- *.whl | sed 's/-py3-none-any.whl//; s/-cp3.*//')
            echo "- installed into \`$SITE\` (PYTHONPATH), from \`$WHEELS\`:" \
                "$(echo "$names" | paste -sd ' ')"
        else
            echo "- FAILED: pip install of \`$WHEELS\` (at most $WHEELS_S s;" \
                "log: \`preflight.log\`): the current environment's packages are used"
        fi
    else
        echo "- no wheel folder \`$WHEELS\`: the current environment's packages are used"
    fi
} >>"$SUMMARY"

# ---- steps 1-5: preflight, trainer rows, ceilings, table (gpu_check.py bounds each step) ----
LEFT=$((TOTAL_S - ($(date +%s) - START)))
timeout -k 10 "$LEFT" "$PY" "$REPO/benchmark/gpu_check.py" "$OUT" "${DRY[@]}" \
    --deadline $((START + TOTAL_S - 5))
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    printf '\n**Stopped by the overall %s s limit (exit %s): %s**\n' "$TOTAL_S" "$rc" \
        'the sections above are what it measured.' >>"$SUMMARY"
fi
echo "gpu_check: exit $rc; $SUMMARY"
exit $rc
