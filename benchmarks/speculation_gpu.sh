#!/usr/bin/env bash
# Speculation on one GPU, in stages that each fit one device call (about 5 minutes): the
# gpt-oss-20b-shaped MXFP4 pair (written on first use, about 90 s), then
#
#   OUT=/some/dir bash benchmarks/speculation_gpu.sh draft   # GPU tests of the graphed draft and verify paths,
#                                                            # then eager vs graphed draft steps, float32 and bf16
#   OUT=/some/dir bash benchmarks/speculation_gpu.sh spec    # the planner (and an arm without its overdraft) against graphed
#                                                            # plain decoding (bench_speculation_gpu.py), float32 then bf16
#   OUT=/some/dir bash benchmarks/speculation_gpu.sh plain   # the loop's plain step taken apart (bench_plain_step.py),
#                                                            # per dtype of DTYPES: in bf16 its decoder-rows arm
#                                                            # prices oracle mode's fixed rows; on CUDA then
#                                                            # probe_row_invariant_linear.py (the dense products)
#   OUT=/some/dir bash benchmarks/speculation_gpu.sh hybrid  # spec with every miss computed on the CPU (the hybrid
#                                                            # guard pinned to GUARD_ARM, default host), plus the
#                                                            # fetch-only plain arm plain-fetch every arm is compared with
#   OUT=/some/dir bash benchmarks/speculation_gpu.sh embedded  # the embedded pair, default `generate` against
#                                                            # --no-draft (bench_default_vs_plain.py --trace, the `make
#                                                            # demo` setting on DEVICE, REPEATS each, default 2): every
#                                                            # run's steps taken apart; needs no checkpoint
#   OUT=/some/dir bash benchmarks/speculation_gpu.sh calls   # the embedded pair's decode loop per function
#                                                            # (time_decode_calls.py: --no-draft, --block-size 1 and
#                                                            # the default, each step split by block length and host
#                                                            # mode), then --no-draft and the default again with SETS
#                                                            # (class attributes, default the pool's linger 2 ms);
#                                                            # REPEATS each (default 2), CALL_TOKENS (default 64);
#                                                            # needs no checkpoint
#
# Every result lands in $OUT as JSON with a .log of its progress; the checkpoints in $WORK.
# A CPU check of this script in a minute: PRESET=tiny DEVICE=cpu EXTRA="--link-gbps 2" TOKENS=12.
set -uo pipefail
STAGE="${1:-}"
case "$STAGE" in draft|spec|plain|hybrid|embedded|calls) ;; *) echo "Error: stage must be draft, spec, plain, hybrid, embedded or calls, got '$STAGE'" >&2; exit 2 ;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
WORK="${WORK:-/tmp/spec}"
PY="${PYTHON:-python3}"
PRESET="${PRESET:-gpt-oss-20b}"
DEVICE="${DEVICE:-cuda}"
EXTRA="${EXTRA:-}"   # e.g. --link-gbps 2 (CPU only)
CKPT="$WORK/$([ "$PRESET" = gpt-oss-20b ] && echo oss20b || echo "$PRESET")"
TOKENS="${TOKENS:-48}"
PROMPTS="${PROMPTS:-2}"          # spec: prompts per dtype
ACCEPT="${ACCEPT:-0.9,0.7,0.3}"  # spec: oracle acceptance rates
BLOCKS="${BLOCKS:-1}"            # spec: fixed block lengths to run besides the planner (1: none)
DTYPES="${DTYPES:-float32 bfloat16}"
GUARD_ARM="${GUARD_ARM:-host}"   # hybrid: the pinned placement (host, model, all, off) or guard (no pin)
SETS="${SETS:-cpu_compute.CpuExpertRunner.prewake_us=2000}"  # calls: space-separated module.Class.attr=value
COMMON=(--checkpoint-dir "$CKPT" --preset "$PRESET" --device "$DEVICE")
mkdir -p "$OUT" "$WORK" 2>/dev/null || { echo "Error: cannot make the output folders (OUT=$OUT, WORK=$WORK): give writable folder paths" >&2; exit 2; }
cd "$ROOT"
export PYTHONUNBUFFERED=1
fail=0
t0=$(date +%s)
run() {  # name, command...: stderr to $OUT/name.log, a non-zero exit remembered
  local name="$1"; shift
  echo "== $name ($(( $(date +%s) - t0 )) s)" >&2
  "$@" 2> "$OUT/$name.log" || { echo "   $name failed, see $OUT/$name.log" >&2; fail=1; }
}

case "$STAGE" in
  draft)
    run draft_graph_tests "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_draft_graphs.py \
      "tests/test_graphs.py::test_cuda_graphed_speculative_decoding_is_lossless"
    for dt in float32 bfloat16; do
      run "draft_graphs_$dt" "$PY" benchmarks/bench_draft_graphs.py "${COMMON[@]}" --dtype "$dt" \
        --out "$OUT/draft_graphs_$dt.json"
    done ;;
  spec)
    for dt in $DTYPES; do
      run "spec_$dt" "$PY" benchmarks/bench_speculation_gpu.py "${COMMON[@]}" $EXTRA --dtypes "$dt" --blocks "$BLOCKS" \
        --tokens "$TOKENS" --prompts "$PROMPTS" --acceptance "$ACCEPT" --no-overdraft-arm --out "$OUT/spec_$dt.json"
    done ;;
  hybrid)
    for dt in $DTYPES; do
      run "hybrid_$dt" "$PY" benchmarks/bench_speculation_gpu.py "${COMMON[@]}" $EXTRA --dtypes "$dt" --blocks "$BLOCKS" \
        --tokens "$TOKENS" --prompts "$PROMPTS" --acceptance "$ACCEPT" --cpu-experts auto --guard-arm "$GUARD_ARM" \
        --out "$OUT/hybrid_$dt.json"
    done ;;
  embedded)
    run default_vs_plain "$PY" benchmarks/bench_default_vs_plain.py --repeats "${REPEATS:-2}" --trace \
      --out "$OUT/default_vs_plain.json" -- --expert-cache-experts 64 --link-gbps 2 --device "$DEVICE" ;;
  calls)
    tdc=("$PY" benchmarks/time_decode_calls.py --device "$DEVICE" --prompt "The river flows" --prompt "Hello, my name is"
         --repeats "${REPEATS:-2}" --max-new-tokens "${CALL_TOKENS:-64}" --show 40
         --setting "--expert-cache-experts 64 --link-gbps 2 $EXTRA")
    run calls "${tdc[@]}" --arms nd,bs1,auto --out "$OUT/calls.json"
    if [ -n "$SETS" ]; then
      sets=()
      for kv in $SETS; do sets+=(--set "$kv"); done
      run calls_sets "${tdc[@]}" --arms nd,auto "${sets[@]}" --out "$OUT/calls_sets.json"
    fi ;;
  plain)
    for dt in $DTYPES; do
      run "plain_step_$dt" "$PY" benchmarks/bench_plain_step.py "${COMMON[@]}" $EXTRA --dtype "$dt" --profile \
        --tokens "$TOKENS" --out "$OUT/plain_step_$dt.json"
    done
    if [ "$DEVICE" = cuda ]; then  # what a row count costs the dense products, and whether they round a row alike
      run row_invariant_linear "$PY" benchmarks/probe_row_invariant_linear.py --preset "$PRESET" --dtype bfloat16 \
        --out "$OUT/row_invariant_linear.json"
    fi ;;
esac
echo "stage $STAGE done in $(( $(date +%s) - t0 )) s, fail=$fail" >&2
exit "$fail"
