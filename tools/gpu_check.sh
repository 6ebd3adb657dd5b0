#!/usr/bin/env bash
# The GPU check: run on a CUDA machine, on the final commit of every change to native/ or
# offload/. Assumes pdflash is installed in the current Python (make install, or on an offline
# machine: pip install --no-build-isolation --no-deps --no-index -e .).
#
#   OUT=/some/dir bash tools/gpu_check.sh          # or: make gpu-check
#
# 1. every GPU-marked test (pytest -m gpu, Triton kernels compiled, not interpreted), then the CPU
#    kernel's own tests on this host's CPU (AMX tiles, which CI's CPUs lack);
# 2. `pdflash smoke --cuda yes --json` SMOKE_RUNS times in a row (default 20), each must pass;
# 3. a gpt-oss-20b-shaped MXFP4 synthetic checkpoint and a short `generate` on it with a 25 %
#    expert cache (192 of 768 experts), speculative-free and with the embedded default pair.
# Writes $OUT/gpu_check.log (everything), $OUT/gpu_tests.log, $OUT/host_cpu_tests.log, $OUT/smoke_runs.json,
# $OUT/generate_gpt_oss_20b.json and $OUT/gpu_check.json (the summary). Exit 0 only if all held.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
WORK="${WORK:-/tmp/pdflash-gpu-check}"
PY="${PYTHON:-python3}"
SMOKE_RUNS="${SMOKE_RUNS:-20}"
TOKENS="${TOKENS:-32}"
mkdir -p "$OUT" "$WORK" 2>/dev/null || { echo "Error: cannot make the output folders (OUT=$OUT, WORK=$WORK): give writable folder paths" >&2; exit 2; }
cd "$ROOT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
fail=0
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1

echo "== GPU-marked tests"
$PY -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] || fail=1

echo "== the CPU kernel's tests on this host (its AMX tiles, where CI's CPUs have none)"
$PY -m pytest -q -m "not gpu" tests/test_cpu_experts.py tests/test_batch_invariant.py -p no:cacheprovider 2>&1 | tee "$OUT/host_cpu_tests.log"
host_rc=${PIPESTATUS[0]}
[ "$host_rc" -eq 0 ] || fail=1

echo "== pdflash smoke --cuda yes, $SMOKE_RUNS runs"
smoke_ok=0
: > "$WORK/smoke.jsonl"
for i in $(seq 1 "$SMOKE_RUNS"); do
  if $PY -m pdflash.cli.main smoke --cuda yes --json > "$WORK/smoke_$i.json"; then smoke_ok=$((smoke_ok + 1)); fi
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({'run': int(sys.argv[2]), 'ok': r['ok'], 'failed': [(b['backend'], c['name'], c['detail']) for b in r['backends'] for c in b['checks'] if not c['ok']], 'close': [c['detail'] for b in r['backends'] for c in b['checks'] if c['name'].startswith('close')]}))" "$WORK/smoke_$i.json" "$i" >> "$WORK/smoke.jsonl" || echo "{\"run\": $i, \"ok\": false, \"failed\": \"no JSON\"}" >> "$WORK/smoke.jsonl"
done
$PY -c "import json,sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1])], indent=1))" "$WORK/smoke.jsonl" > "$OUT/smoke_runs.json"
echo "smoke: $smoke_ok of $SMOKE_RUNS runs passed"
# every failed check in the log too, so a log alone says what failed
$PY -c "import json,sys; [print('smoke run', r['run'], 'failed:', r['failed']) for r in map(json.loads, open(sys.argv[1])) if not r['ok']]" "$WORK/smoke.jsonl"
[ "$smoke_ok" -eq "$SMOKE_RUNS" ] || fail=1

echo "== generate on the gpt-oss-20b shape (25 % expert cache)"
CK="$WORK/gpt-oss-20b"
if [ ! -f "$CK/config.json" ]; then
  $PY -m pdflash.cli.main make-synthetic "$CK" --preset gpt-oss-20b --mxfp4 --json > "$WORK/make_synthetic.json" || fail=1
fi
$PY -m pdflash.cli.main generate "The capital of France is" --model "$CK" --device cuda --expert-cache-experts 192 \
  --max-new-tokens "$TOKENS" --no-draft --no-live --json > "$OUT/generate_gpt_oss_20b.json"
gen_rc=$?
[ "$gen_rc" -eq 0 ] || fail=1
$PY -m pdflash.cli.main generate "def fibonacci(n):" --device cuda --max-new-tokens "$TOKENS" --no-live --json > "$WORK/generate_embedded.json"
emb_rc=$?
[ "$emb_rc" -eq 0 ] || fail=1

$PY - "$OUT" "$tests_rc" "$smoke_ok" "$SMOKE_RUNS" "$gen_rc" "$emb_rc" "$WORK/generate_embedded.json" "$host_rc" <<'PYEOF'
import json, sys, re
out, tests_rc, smoke_ok, runs, gen_rc, emb_rc, emb, host_rc = sys.argv[1:]
tail = open(f"{out}/gpu_tests.log").read().strip().splitlines()[-1:]
host_tail = open(f"{out}/host_cpu_tests.log").read().strip().splitlines()[-1:]
def rate(path):
    try:
        r = json.load(open(path))
        return {k: r.get(k) for k in ("generated_tokens", "tokens_per_second", "bytes_per_token", "exposed_fetch_seconds", "cuda_graphs")}
    except Exception as exc:
        return {"error": repr(exc)}
summary = {
    "gpu_tests": {"exit_code": int(tests_rc), "summary": tail[0] if tail else ""},
    "host_cpu_tests": {"exit_code": int(host_rc), "summary": host_tail[0] if host_tail else ""},
    "smoke": {"passed": int(smoke_ok), "runs": int(runs)},
    "generate_gpt_oss_20b_25pct": dict(exit_code=int(gen_rc), **rate(f"{out}/generate_gpt_oss_20b.json")),
    "generate_embedded": dict(exit_code=int(emb_rc), **rate(emb)),
}
summary["ok"] = int(tests_rc) == 0 and int(host_rc) == 0 and smoke_ok == runs and int(gen_rc) == 0 and int(emb_rc) == 0
json.dump(summary, open(f"{out}/gpu_check.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PYEOF
echo "gpu check: $([ $fail -eq 0 ] && echo PASSED || echo FAILED)"
exit $fail
