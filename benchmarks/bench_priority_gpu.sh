#!/usr/bin/env bash
# bench-priority on one GPU (written for an H200 on PCIe Gen5): the gpt-oss-20b-shaped MXFP4
# synthetic target with its gpt-oss-20b-DFlash-shaped synthetic draft, oracle-acceptance mode
# P = 0.7 by default (ACCEPT; random draft weights accept nothing; the draft still runs every step), expert cache
# 25 % of all experts for the budget arms, all five arms, peers (transformers resident and
# accelerate offload capped at pdflash's GPU budget) on the same prompts.
#
#   OUT=/some/dir bash benchmarks/bench_priority_gpu.sh          # both stages
#   bash benchmarks/bench_priority_gpu.sh make                     # only write the checkpoints
#   bash benchmarks/bench_priority_gpu.sh bench                    # only the benchmark (checkpoints exist)
#
# Writes $OUT/bm3.json, $OUT/bm3.png, $OUT/bm3.txt (the tables and verdict), $OUT/bm3.log
# (progress), $OUT/make_synthetic.json. The checkpoints (about 14 GB) go to $WORK, reused when
# present. Sized to finish in about 8 minutes; knobs below via the environment.
set -euo pipefail
STAGE="${1:-all}"
case "$STAGE" in all|make|bench) ;; *) echo "Error: stage must be all, make or bench, got '$STAGE'" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
WORK="${WORK:-/tmp/pdflash-bm3}"
PY="${PYTHON:-python3}"
REPS="${REPS:-5}"
PROMPTS="${PROMPTS:-3}"
TOKENS="${TOKENS:-32}"
ARMS="${ARMS:-flat,banded,on-demand,resident,oracle}"
PEER_LIMIT="${PEER_LIMIT:-60}"
PEERS="${PEERS:-1}"                           # 0: pdflash's arms only
ACCEPT="${ACCEPT:-0.7}"                       # the oracle acceptance rate P
DEVICE="${DEVICE:-cuda}"
PRESET="${PRESET:-gpt-oss-20b}"               # PRESET=tiny DRAFT_PRESET=tiny DEVICE=cpu EXTRA="--link-gbps 0.05":
DRAFT_PRESET="${DRAFT_PRESET:-gpt-oss-20b-DFlash}"  # a CPU check of this script in seconds
EXTRA="${EXTRA:-}"
CKPT="$WORK/$PRESET-mxfp4"
mkdir -p "$OUT" "$WORK" 2>/dev/null || { echo "Error: cannot make the output folders (OUT=$OUT, WORK=$WORK): give writable folder paths" >&2; exit 2; }
cd "$ROOT"

# pdflash importable with its native scheduler built (editable install compiles it)
if ! "$PY" -c "import pdflash.native._pf_sched" 2>/dev/null; then
  "$PY" -m pip install -q --no-build-isolation -e . || "$PY" -m pdflash.cli.main build-native
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/gpu.csv" || true

t0=$(date +%s)
if [ "$STAGE" != bench ]; then
  if [ ! -f "$CKPT/config.json" ] || [ ! -f "$CKPT/draft/config.json" ]; then
    "$PY" -m pdflash.cli.main make-synthetic "$CKPT" --preset "$PRESET" --mxfp4 \
      --draft-preset "$DRAFT_PRESET" --json > "$OUT/make_synthetic.json"
  fi
  echo "checkpoints ready in $(( $(date +%s) - t0 )) s" >&2
  [ "$STAGE" = make ] && exit 0
fi

"$PY" -m pdflash.cli.main bench-priority \
  --model "$CKPT" --draft "$CKPT/draft" --device "$DEVICE" $EXTRA \
  --arms "$ARMS" --repetitions "$REPS" --prompts "$PROMPTS" --max-new-tokens "$TOKENS" \
  --draft-acceptance "$ACCEPT" --expert-cache-fraction 0.25 --seed 0 --warmup 1 \
  $([ "$PEERS" = 1 ] && echo --peers --peer-time-limit "$PEER_LIMIT") \
  --output "$OUT/bm3.json" 2> >(tee "$OUT/bm3.log" >&2) | tee "$OUT/bm3.txt"
echo "total $(( $(date +%s) - t0 )) s" >&2
