#!/usr/bin/env bash
# Hybrid expert execution on one GPU machine, in stages that together fit one device call
# (at most 10 minutes): name the stages to run, in order; each has its own time limit and writes
# everything it produced under $OUT/<stage>/, so nothing stays behind on the machine.
#
#   OUT=/some/dir bash benchmarks/hybrid_gpu.sh check 20b desktop
#
#   check    tools/gpu_check.sh (SMOKE_RUNS, default 1; TOKENS, default 16), all its files; LIMIT_CHECK
#            default 360 s (210 s on a fast H100 host; a slower one passed 270 s before its last step)
#   20b      check_hybrid_gpu.py, gpt-oss-20b shape in memory, 25 % cache, CUDA graphs, bf16,
#            MODES_20B (default off,all,auto-host,auto-model,auto)
#   desktop  the same with the link paced to 25 GB/s and 8 CPU threads, MODES_DESKTOP
#            (default off,all,auto-host,auto-model,auto)
#   120b     gpt-oss-120b shape in memory, 8 GiB of cache (0.1408 of its experts), MODES_120B
#            (default auto-host,auto-model)
#   threads  the 20b stage once per kernel thread count in THREADS (default 12,14,16; LIMIT_THREADS
#            seconds each), MODES_THREADS
#            (default auto-host,auto-model): how many cores the split's prefetches need beside the
#            kernel's pool (each count under $OUT/threads/t<N>/); PRESET_THREADS and CACHE_THREADS
#            (a cache fraction) run another shape, e.g. gpt-oss-120b and 0.1408 (8 GiB)
#   handoff  handoff_gpu.py: one device -> CPU -> device hand-off in a captured graph, host node
#            against stream memory operations (LIMIT_HANDOFF, default 120 s)
#   sweep    benchmarks/kernel_sweep.sh: the CPU kernel rebuilt per value of its compile-time knobs
#            (SWEEP_VARIANTS, default the script's), timed against this host's DRAM read at
#            SWEEP_THREADS (default 12,14,16), SWEEP_ARGS passed on (LIMIT_SWEEP, default 240 s)
#   llama    the peer on the same machine: bench_llamacpp.sh, gpt-oss-120b in MXFP4 at --n-cpu-moe
#            LLAMA_NCMOE (default 36,31,30: every expert on the CPU, then 5 and 6 of 36 layers' experts
#            on the GPU, around the 120b stage's 8 GiB cache), from LLAMA_SRC (default
#            .peers/llama.cpp-src.tar.gz, see that script), built into LLAMA_BUILD (default
#            /tmp/pdflash-llamacpp-build, kept for later calls on a warm machine); LIMIT_LLAMA
#            default 300 s. Run it after the 120b stage: the synthetic GGUF needs the host memory
#            pdflash's store held.
#
# TOKENS_HYBRID (default 48) tokens per run; LIMIT_<STAGE> (seconds) overrides a stage's limit.
# PACK=1: at the end, every stage's folder goes into one archive, $OUT/stages.tgz (the device tool
# brings back at most 8 files from $OUT; the check stage alone writes more).
# A CPU check of the script: DEVICE=cpu PRESET_20B=tiny MODES_20B=off,all TOKENS_HYBRID=4 ... 20b
# (no CUDA graphs on the CPU).
# Exit status: 0 when every stage finished with status 0, else 1 (each stage's status is in
# $OUT/status.txt); 2 for an unknown stage. Before it, on a machine without network, install
# pdflash's build dependency from local wheels (see docs/gpu_check.md).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
PY="${PYTHON:-python3}"
TOKENS_HYBRID="${TOKENS_HYBRID:-48}"
DEVICE="${DEVICE:-cuda}"
GRAPHS=$([ "$DEVICE" = cuda ] && echo --cuda-graphs)
STAGES="check 20b desktop 120b threads handoff sweep llama"
[ "$#" -ge 1 ] || { echo "Error: name one or more stages: ${STAGES// /, }" >&2; exit 2; }
for stage in "$@"; do
  known=0
  for s in $STAGES; do [ "$stage" = "$s" ] && known=1; done
  [ "$known" -eq 1 ] || { echo "Error: unknown stage '$stage': use ${STAGES// /, }" >&2; exit 2; }
done
mkdir -p "$OUT" 2>/dev/null || { echo "Error: cannot make the output folders (OUT=$OUT): give writable folder paths" >&2; exit 2; }
cd "$ROOT"
fail=0

hybrid() {  # name limit args...
  local name="$1" limit="$2"
  shift 2
  timeout "$limit" "$PY" benchmarks/check_hybrid_gpu.py --device "$DEVICE" $GRAPHS --dtypes bfloat16 \
    --tokens "$TOKENS_HYBRID" --out "$OUT/$name/hybrid.json" "$@" > "$OUT/$name/hybrid.log" 2>&1
}

for stage in "$@"; do
  mkdir -p "$OUT/$stage"
  start=$(date +%s)
  case "$stage" in
    check)
      OUT="$OUT/check" WORK="${WORK:-/tmp/pdflash-gpu-check}" SMOKE_RUNS="${SMOKE_RUNS:-1}" TOKENS="${TOKENS:-16}" \
        PYTHON="$PY" timeout "${LIMIT_CHECK:-360}" bash tools/gpu_check.sh > "$OUT/check/stdout.log" 2>&1
      ;;
    20b)
      hybrid 20b "${LIMIT_20B:-240}" --in-memory "${PRESET_20B:-gpt-oss-20b}" --modes "${MODES_20B:-off,all,auto-host,auto-model,auto}"
      ;;
    desktop)
      hybrid desktop "${LIMIT_DESKTOP:-240}" --in-memory gpt-oss-20b --link-gbps 25 --cpu-threads 8 \
        --modes "${MODES_DESKTOP:-off,all,auto-host,auto-model,auto}"
      ;;
    threads)
      rc_all=0
      threads="${THREADS:-12,14,16}"
      for n in ${threads//,/ }; do
        mkdir -p "$OUT/threads/t$n"
        hybrid "threads/t$n" "${LIMIT_THREADS:-200}" --in-memory "${PRESET_THREADS:-${PRESET_20B:-gpt-oss-20b}}" \
          ${CACHE_THREADS:+--cache-fraction "$CACHE_THREADS"} --cpu-threads "$n" \
          --modes "${MODES_THREADS:-auto-host,auto-model}" || rc_all=1
      done
      [ "$rc_all" -eq 0 ]
      ;;
    handoff)
      timeout "${LIMIT_HANDOFF:-120}" "$PY" benchmarks/handoff_gpu.py --out "$OUT/handoff/handoff.json" > "$OUT/handoff/handoff.log" 2>&1
      ;;
    120b)
      hybrid 120b "${LIMIT_120B:-360}" --in-memory gpt-oss-120b --cache-fraction 0.1408 --modes "${MODES_120B:-auto-host,auto-model}"
      ;;
    sweep)
      env OUT="$OUT/sweep" THREADS="${SWEEP_THREADS:-12,14,16}" ARGS="${SWEEP_ARGS:-}" PYTHON="$PY" \
        ${SWEEP_VARIANTS:+"VARIANTS=$SWEEP_VARIANTS"} timeout "${LIMIT_SWEEP:-240}" bash benchmarks/kernel_sweep.sh \
        > "$OUT/sweep/sweep.log" 2>&1
      ;;
    llama)
      limit="${LIMIT_LLAMA:-300}"
      timeout "$limit" bash benchmarks/bench_llamacpp.sh --src "${LLAMA_SRC:-$ROOT/.peers/llama.cpp-src.tar.gz}" \
        --out "$OUT/llama" --models "gpt-oss-120b:mxfp4" \
        --ncmoe "${LLAMA_NCMOE:-36,31,30}" --n-gen 32 --reps 2 --deadline $((limit - 10)) \
        --build-dir "${LLAMA_BUILD:-/tmp/pdflash-llamacpp-build}" > "$OUT/llama/llama.log" 2>&1
      ;;
  esac
  rc=$?
  [ "$rc" -eq 0 ] || fail=1
  echo "$stage: status $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/status.txt"
  grep -hE " %\) \||tok/s|host steps \(|route-ahead|gpu check:|smoke run|passed|failed|us_per_layer|handoff_us|\"error\"" "$OUT/$stage"/*.log "$OUT/$stage"/*/*.log 2>/dev/null | tail -24
done
if [ "${PACK:-0}" = 1 ]; then
  dirs=()
  for stage in "$@"; do [ -d "$OUT/$stage" ] && dirs+=("$stage"); done
  [ "${#dirs[@]}" -eq 0 ] || { tar -czf "$OUT/stages.tgz" -C "$OUT" "${dirs[@]}" && rm -rf "${dirs[@]/#/$OUT/}"; }
fi
exit "$fail"
