#!/usr/bin/env bash
# The CPU expert kernel's compile-time knobs, swept on this machine (benchmarks/kernel_sweep.c: one
# build of native/pf_cpu.c per variant, timed against this machine's DRAM read):
#
#   OUT=/some/dir bash benchmarks/kernel_sweep.sh
#   VARIANTS="base PREFETCH_ROWS=0 PREFETCH_ROWS=16" THREADS=16 ARGS="--calls 50" bash benchmarks/kernel_sweep.sh
#
# VARIANTS: space-separated, each "base" (the library's own values) or KNOB=VALUE[,KNOB=VALUE...]
# with KNOB one of PREFETCH_ROWS (MXFP4 rows prefetched ahead, the library's 8), MX_SUPER (rows a
# block of the AVX-512 kernels keeps in L1 for every token pair, the library's 8), POOL_LINES
# (1: the pool's shared words on cache lines of their own; the library's 0) and HUGE_PAGES (1: the
# weights, and so the DRAM read too, on 2 MiB transparent huge pages; 0, as the host store is: 4 KiB
# pages where THP is "madvise"), GRAB_SHARE (a grab of a phase's units takes 1 / (GRAB_SHARE x threads) of
# those left, the library's 1), GRAB_MAX (units a grab takes at most, the library's 64), GRAB_FIRST (percent
# of a phase's units first handed out in one equal grab a thread, the library's 0) and GRAB_STREAM (1: a grab prefetches its own first rows and nothing past
# its last; the library's 1). Default: base, PREFETCH_ROWS 0 / 4 / 16 / 32, MX_SUPER 4 / 16,
# POOL_LINES 1, HUGE_PAGES 1. THREADS (default 12,14,16), ARGS (more options of
# kernel_sweep.c, e.g. --experts, --hidden, --calls). Every variant runs twice, the second pass in
# reverse order, so that drift on a shared machine falls on every variant alike. Writes
# $OUT/kernel_sweep.jsonl (one object per variant, pass and thread count, with "variant" and
# "pass"; "one_us" takes a one-expert call apart, see kernel_sweep.c) and prints two tables.
# Exit 0, 1 if a variant failed to build, to check out or to run, 2 for a malformed variant.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
CC="${CC:-cc}"
PY="${PYTHON:-python3}"
VARIANTS="${VARIANTS:-base PREFETCH_ROWS=0 PREFETCH_ROWS=4 PREFETCH_ROWS=16 PREFETCH_ROWS=32 MX_SUPER=4 MX_SUPER=16 POOL_LINES=1 HUGE_PAGES=1}"
THREADS="${THREADS:-12,14,16}"
ARGS="${ARGS:-}"
mkdir -p "$OUT" 2>/dev/null || { echo "Error: cannot make the output folders (OUT=$OUT): give writable folder paths" >&2; exit 2; }
BIN="$(mktemp -d)"
trap 'rm -rf "$BIN"' EXIT
fail=0
names=()
for v in $VARIANTS; do
  defs=()
  if [ "$v" != base ]; then
    for kv in ${v//,/ }; do
      if [[ ! "$kv" =~ ^(PREFETCH_ROWS|MX_SUPER|POOL_LINES|HUGE_PAGES|GRAB_SHARE|GRAB_MAX|GRAB_FIRST|GRAB_STREAM)=[0-9]+$ ]]; then
        echo "Error: variant '$v': use base or PREFETCH_ROWS=N / MX_SUPER=N / POOL_LINES=0|1 / HUGE_PAGES=0|1 / GRAB_SHARE=N / GRAB_MAX=N / GRAB_FIRST=0..100 / GRAB_STREAM=0|1, comma-separated" >&2
        exit 2
      fi
      defs+=("-D$kv")
    done
  fi
  name="${v//[=,]/_}"
  if ! "$CC" -std=c11 -O2 -pthread -I"$ROOT/native" "${defs[@]}" -o "$BIN/$name" "$ROOT/benchmarks/kernel_sweep.c" -lm; then
    echo "variant $v: build failed" >&2
    fail=1
    continue
  fi
  names+=("$v")
done
: > "$OUT/kernel_sweep.jsonl"
order=("${names[@]}")
for pass in 1 2; do
  for v in "${order[@]}"; do
    name="${v//[=,]/_}"
    # shellcheck disable=SC2086
    if ! "$BIN/$name" --threads "$THREADS" $ARGS > "$BIN/out.jsonl"; then
      echo "variant $v: run failed" >&2
      fail=1
      continue
    fi
    "$PY" -c 'import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line); r["variant"] = sys.argv[2]; r["pass"] = int(sys.argv[3]); print(json.dumps(r))' \
      "$BIN/out.jsonl" "$v" "$pass" >> "$OUT/kernel_sweep.jsonl"
  done
  reversed=()
  for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[$i]}"); done
  order=("${reversed[@]}")
done
"$PY" - "$OUT/kernel_sweep.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| variant | threads | DRAM read GB/s | one expert ms (GB/s, of DRAM) | 8 experts ms (GB/s, of DRAM) |")
print("|---|---:|---:|---:|---:|")
for key in dict.fromkeys((r["variant"], r["threads"]) for r in rows):
    rs = [r for r in rows if (r["variant"], r["threads"]) == key]
    mean = lambda k: sum(r[k] for r in rs) / len(rs)
    print(f"| {key[0]} | {key[1]} | {mean('dram_gbps'):.1f} | {mean('one_ms'):.3f} ({mean('one_gbps'):.1f}, "
          f"{100 * mean('one_of_dram'):.0f} %) | {mean('layer8_ms'):.3f} ({mean('layer8_gbps'):.1f}, "
          f"{100 * mean('layer8_of_dram'):.0f} %) |")
parts = list(next((r["one_us"] for r in rows if "one_us" in r), {}))  # kernel_sweep.c's PART_NAMES, in order
print()
print("One expert's call, median us: " + ", ".join(parts))
print("| variant | threads | " + " | ".join(parts) + " |")
print("|---|---:|" + "---:|" * len(parts))
for key in dict.fromkeys((r["variant"], r["threads"]) for r in rows):
    rs = [r for r in rows if (r["variant"], r["threads"]) == key and "one_us" in r]
    if rs:
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{sum(r['one_us'][p] for r in rs) / len(rs):.1f}" for p in parts) + " |")
PYEOF
exit "$fail"
