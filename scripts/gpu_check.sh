#!/usr/bin/env bash
# GPU check: on a machine with NVIDIA GPUs, in one go (about 10 minutes at most on one H200):
#   1. the tests marked `cuda` (+ the CUDA attention rules on meta tensors);
#   2. the trainer on the GPUs with NCCL (torchrun) for the FSDP, TP, FSDP+TP and CP layouts
#      that fit the GPU count, each compared step by step with the same run on one GPU;
#   3. benchmarks/overlap.py (shardwise vs torch's fully_shard, prefetch on/off) and
#      benchmarks/train_step.py --quick (shardwise vs torch's DTensor; these two run on CPU
#      ranks with gloo, as reference figures from the same machine);
# then prints one table. Usage: scripts/gpu_check.sh [STEPS]   (default 20 trainer steps)
#
# GPUs: N = `nvidia-smi -L | wc -l`. NCCL refuses two ranks on one GPU, so multi-rank layouts
# need N >= their world size: FSDP and TP use min(N, 4) ranks, FSDP+TP and CP need 4 and 2.
# With one GPU the trainer runs with world size 1 under torchrun (NCCL, one-rank meshes: the
# CUDA kernels, the dispatcher and the collectives' one-rank paths) and the multi-rank layouts
# are reported as "skipped (1 GPU)".
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=${1:-20}
CONFIG=${GPU_CHECK_CONFIG:-debug}
TOL=${GPU_CHECK_TOL:-0.02}   # largest relative loss difference to the one-GPU run, any step
# Dry run of this script on a machine without GPUs: GPU_CHECK_DEVICE=cpu GPU_CHECK_GPUS=2 (gloo ranks).
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then N=$(nvidia-smi -L 2>/dev/null | wc -l); else N=${GPU_CHECK_GPUS:-2}; fi
if [ "$N" -lt 1 ]; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L lists none)"; exit 2
fi
OUT=$(mktemp -d /tmp/gpu_check.XXXXXX)
ROWS="$OUT/rows.tsv"
: > "$ROWS"
STATUS=0
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$ROWS"; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

echo "gpu_check: $N GPU(s); logs in $OUT"

# ---------------------------------------------------------------- 1. tests
t=$(date +%s)
if timeout 180 python -m pytest -q -m cuda tests/ > "$OUT/pytest_cuda.log" 2>&1 \
   && timeout 120 python -m pytest -q tests/test_ops_attention_cuda.py >> "$OUT/pytest_cuda.log" 2>&1; then
    row "pytest -m cuda (+ meta rules)" "ok" "$(grep -E ' in [0-9.]+s' "$OUT/pytest_cuda.log" | tr -d '=' | paste -sd ';') ($(elapsed "$t"))"
else
    row "pytest -m cuda (+ meta rules)" "FAIL" "see $OUT/pytest_cuda.log ($(elapsed "$t"))"; STATUS=1
fi

# ---------------------------------------------------------------- 2. trainer layouts
train() {  # name world -- trainer flags
    local name=$1 world=$2; shift 3
    local t; t=$(date +%s)
    if [ "$world" -eq 1 ] && [ "$name" = single ]; then
        timeout 240 python -m shardwise.train --device "$DEVICE" --config "$CONFIG" --steps "$STEPS" --log-every 1000 \
            --metrics-file "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
    else
        timeout 240 torchrun --standalone --nproc-per-node "$world" -m shardwise.train --device "$DEVICE" \
            --config "$CONFIG" --steps "$STEPS" --log-every 1000 --metrics-file "$OUT/$name.json" "$@" \
            > "$OUT/$name.log" 2>&1
    fi
    local rc=$?
    if [ $rc -ne 0 ]; then
        row "train $name (world $world)" "FAIL" "exit $rc, see $OUT/$name.log ($(elapsed "$t"))"; STATUS=1; return
    fi
    if [ "$name" = single ]; then
        row "train single (1 GPU)" "ok" "$(python - "$OUT/single.json" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"loss {m['losses'][0]:.4f} -> {m['final_loss']:.4f}, median step {m['median_step_s']:.3f} s")
EOF
) ($(elapsed "$t"))"
        return
    fi
    local verdict
    verdict=$(python - "$OUT/single.json" "$OUT/$name.json" "$TOL" <<'EOF'
import json, sys
one, many, tol = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(one["losses"], many["losses"]))
ok = diff <= tol and len(one["losses"]) == len(many["losses"])
print(("ok" if ok else "FAIL") + f"\tloss rel diff vs 1 GPU {diff:.1e} (tol {tol:g}), "
      f"median step {many['median_step_s']:.3f} s (1 GPU {one['median_step_s']:.3f} s)")
EOF
)
    case "$verdict" in FAIL*) STATUS=1;; esac
    row "train $name (world $world)" "${verdict%%	*}" "${verdict#*	} ($(elapsed "$t"))"
}

train single 1 --
W=$(( N >= 4 ? 4 : N ))
if [ "$N" -eq 1 ]; then
    train fsdp_world1 1 -- --dp-shard 1
    for layout in "fsdp" "tp" "fsdp_tp" "cp"; do row "train $layout" "skipped" "1 GPU: NCCL takes one GPU per rank"; done
else
    train fsdp "$W" -- --dp-shard "$W"
    train tp "$W" -- --tp "$W" --dp-shard 1
    if [ "$N" -ge 4 ]; then train fsdp_tp 4 -- --dp-shard 2 --tp 2; else row "train fsdp_tp" "skipped" "needs 4 GPUs"; fi
    train cp 2 -- --cp 2 --dp-shard 1
fi

# ---------------------------------------------------------------- 3. benchmarks (CPU ranks, gloo)
bench() {  # name log summary-grep -- command...
    local name=$1 log=$2 pick=$3; shift 4
    local t; t=$(date +%s)
    if timeout 180 "$@" > "$OUT/$log" 2>&1; then
        row "$name" "ok" "$(grep -E "$pick" "$OUT/$log" | tail -1) ($(elapsed "$t"))"
    else
        row "$name" "FAIL" "see $OUT/$log ($(elapsed "$t"))"; STATUS=1
    fi
}
if [ -n "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    row "benchmarks" "skipped" "GPU_CHECK_SKIP_BENCH is set"
else
    bench "benchmarks/overlap.py --quick" overlap.log "prefetch on/off" -- python benchmarks/overlap.py --quick
    bench "benchmarks/train_step.py --quick" train_step.log "shardwise/torch step time" -- \
        python benchmarks/train_step.py --quick --modes fsdp,tp
fi

# ---------------------------------------------------------------- the table
echo
printf '%-36s %-8s %s\n' "check" "result" "details"
printf '%s\n' "$(printf '%.0s-' {1..110})"
while IFS=$'\t' read -r name result details; do printf '%-36s %-8s %s\n' "$name" "$result" "$details"; done < "$ROWS"
for log in "$OUT/overlap.log" "$OUT/train_step.log"; do
    [ -f "$log" ] && { echo; echo "== $(basename "$log")"; sed -n '/^variant\|^mode/,$p' "$log"; }
done
exit $STATUS
