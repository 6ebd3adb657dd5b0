#!/usr/bin/env bash
# Peer benchmark: llama.cpp's llama-bench with --n-cpu-moe (the experts of the first N layers on
# the CPU, everything else on the GPU) on synthetic GGUFs with the exact shapes of pdflash's presets.
#
# One command on the GPU machine (no network needed):
#   1. unpacks the llama.cpp source (the trimmed tarball .peers/llama.cpp-src.tar.gz, see
#      PEER_SOURCE.json inside it; or an unpacked tree) and builds only llama-bench (Release, Ninja,
#      CUDA for --cuda-arch, native CPU; no curl/server/tests/examples). The build folder (default
#      .peers/build-cuda, git-ignored) is kept and reused by later calls with the same source;
#   2. meanwhile writes the first synthetic GGUF (benchmarks/llamacpp_gguf.py) to /dev/shm in the
#      background; models are written, run and deleted one at a time (a 61-65 GB model does not
#      fit on the disk next to anything else);
#   3. runs `llama-bench -m FILE -ngl 99 -ncmoe N -p 0 -n 32 -r 2 -t THREADS -fa 1 -o json -v`, one
#      process per N: llama-bench reloads the model for every --n-cpu-moe value anyway, and one
#      process per value gives a clean per-value peak. GPU memory (nvidia-smi) and the host RSS of
#      llama-bench are sampled about every 0.25 s while it runs;
#   4. writes OUT/llamacpp_<preset>.json (llama-bench's records, peak VRAM and RSS, llama.cpp's
#      buffer sizes, build info and timings, per value), OUT/llamacpp_bench.log, the logs under
#      OUT/llamacpp_logs/, and prints one summary line per value.
# A total deadline (--deadline) bounds everything: what no longer fits is skipped and recorded as
# skipped, every child runs under `timeout`, and the GGUFs written here are deleted on exit (unless
# --keep-models).
#
# Local check without a GPU: --cpu (or LLAMACPP_BENCH_CPU=1) builds without CUDA; everything else is
# the same code (VRAM is sampled whenever an nvidia-smi is on PATH).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$REPO/.peers/llama.cpp-src.tar.gz"
OUT_DIR="${OUT:-}"
MODELS="qwen3-30b-a3b:bf16 gpt-oss-120b:mxfp4"
NCMOE_SPEC=""
THREADS="$(nproc)"
NGEN=32
REPS=2
DEADLINE=570
MODEL_DIR=""
BUILD_DIR=""
JOBS="$(nproc)"
WRITE_THREADS=8
CUDA_ARCH=90
CPU_MODE="${LLAMACPP_BENCH_CPU:-0}"
PY="${PYTHON:-python3}"
KEEP_MODELS=0
SEED=0
BENCH_ARGS=""
BENCH_BIN=""

usage() {
    cat <<'EOF'
usage: benchmarks/bench_llamacpp.sh [options]
  --src PATH          llama.cpp source: a .tar.gz (top folder llama.cpp/) or an unpacked tree
                      (default: .peers/llama.cpp-src.tar.gz)
  --out DIR           results folder (default: $OUT)
  --models LIST       PRESET[:EXPERT_TYPE[:DENSE_TYPE]] entries, space or comma separated, run in
                      this order (default: "qwen3-30b-a3b:bf16 gpt-oss-120b:mxfp4"); expert types
                      bf16|q8_0|mxfp4 (default: mxfp4 for gpt-oss, bf16 for qwen3), dense types
                      bf16|q8_0 (default bf16; see benchmarks/llamacpp_gguf.py)
  --ncmoe SPEC        --n-cpu-moe values per preset: "PRESET=A,B,C;PRESET2=D,E" (a bare "A,B,C"
                      applies to every preset); default 0, L/4, L/2, 3L/4, L for L layers
  --threads N         llama-bench -t (default: nproc)
  --n-gen N           generated tokens per run, llama-bench -n (default 32)
  --reps N            llama-bench -r (default 2)
  --deadline S        seconds for everything, build included (default 570)
  --model-dir DIR     where the GGUFs go (default: /dev/shm/pdflash-llamacpp, else
                      /tmp/pdflash-llamacpp/models when /dev/shm lacks room)
  --build-dir DIR     build folder (default: .peers/build-cuda, or .peers/build-cpu with --cpu)
  --jobs N            build parallelism (default: nproc)
  --write-threads N   threads of the GGUF writer (default 8; 2 for the first GGUF, written during the build)
  --cuda-arch A       CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200)
  --cpu               no CUDA (local check)
  --python PY         interpreter for the GGUF writer and the JSON (default: $PYTHON or python3)
  --seed N            GGUF values seed (default 0)
  --keep-models       keep the GGUFs (default: each is deleted after its runs)
  --bench-args "A"    extra llama-bench arguments for every run (e.g. "--no-host 1")
  --bench-bin PATH    use this llama-bench and skip the build

Host memory: with CUDA, llama.cpp copies the experts it keeps on the CPU into pinned host buffers
(CUDA_Host), on top of the GGUF that sits in /dev/shm. When MemAvailable before a run is below
those experts + 6 GiB, that run gets "--no-host 1 --repack 0" (experts read in place from the
mapped file; the same CPU kernels for decoding) and the JSON says so ("host_buffers").
EOF
}

die() { echo "bench_llamacpp: error: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --src) SRC="$2"; shift 2 ;;
        --out) OUT_DIR="$2"; shift 2 ;;
        --models) MODELS="$2"; shift 2 ;;
        --ncmoe) NCMOE_SPEC="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --n-gen) NGEN="$2"; shift 2 ;;
        --reps) REPS="$2"; shift 2 ;;
        --deadline) DEADLINE="$2"; shift 2 ;;
        --model-dir) MODEL_DIR="$2"; shift 2 ;;
        --build-dir) BUILD_DIR="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        --write-threads) WRITE_THREADS="$2"; shift 2 ;;
        --cuda-arch) CUDA_ARCH="$2"; shift 2 ;;
        --cpu) CPU_MODE=1; shift ;;
        --python) PY="$2"; shift 2 ;;
        --seed) SEED="$2"; shift 2 ;;
        --keep-models) KEEP_MODELS=1; shift ;;
        --bench-args) BENCH_ARGS="$2"; shift 2 ;;
        --bench-bin) BENCH_BIN="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
for v in THREADS NGEN REPS DEADLINE JOBS WRITE_THREADS SEED; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, got '${!v}'"
done
(( WRITE_THREADS >= 1 && THREADS >= 1 && JOBS >= 1 && REPS >= 1 && NGEN >= 1 )) || die "--threads, --jobs, --write-threads, --reps and --n-gen must be >= 1"
[[ -n "$OUT_DIR" ]] || die "no results folder: pass --out DIR or set OUT"
[[ -e "$SRC" ]] || die "no llama.cpp source at $SRC"
command -v "$PY" >/dev/null || die "python interpreter '$PY' not found"
[[ "$CPU_MODE" == 1 ]] || CPU_MODE=0
mkdir -p "$OUT_DIR/llamacpp_logs" || die "cannot create $OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if [[ -z "$BUILD_DIR" ]]; then
    if [[ "$CPU_MODE" == 1 ]]; then BUILD_DIR="$REPO/.peers/build-cpu"; else BUILD_DIR="$REPO/.peers/build-cuda"; fi
fi
HAVE_SMI=0
if command -v nvidia-smi >/dev/null; then HAVE_SMI=1; fi

T0=$(date +%s)
DEADLINE_TS=$((T0 + DEADLINE))
WORK="$(mktemp -d /tmp/pdflash-llamacpp-run.XXXXXX)"
LOG="$OUT_DIR/llamacpp_bench.log"
: > "$LOG"
WRITER_PID=""
SAMPLER_PID=""
MODEL_FILE=""
WRITE_T0=0
MODELS_WRITTEN=()

now() { date +%s; }
remaining() { echo $((DEADLINE_TS - $(now))); }
tleft() { local r=$((DEADLINE_TS - $(now))); echo $(( r < 1 ? 1 : r )); }  # for timeout (0 would mean none)
log() { echo "[bench_llamacpp +$(( $(now) - T0 ))s] $*" | tee -a "$LOG" >&2; }

cleanup() {
    local rc=$?
    if [[ -n "$SAMPLER_PID" ]]; then kill "$SAMPLER_PID" 2>/dev/null || true; fi
    if [[ -n "$WRITER_PID" ]]; then kill "$WRITER_PID" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    if [[ "$KEEP_MODELS" != 1 ]]; then
        for f in "${MODELS_WRITTEN[@]+"${MODELS_WRITTEN[@]}"}"; do rm -f "$f" "$f.partial"; done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

log "mode=$([[ $CPU_MODE == 1 ]] && echo cpu || echo cuda) deadline=${DEADLINE}s out=$OUT_DIR models='$MODELS' threads=$THREADS n_gen=$NGEN reps=$REPS nvidia-smi=$HAVE_SMI"

# -- 1. source --------------------------------------------------------------------------------------
t=$(now)
if [[ -d "$SRC" ]]; then
    SRC_DIR="$(cd "$SRC" && pwd)"
else
    TAR_ID="$(sha256sum "$SRC" | cut -c1-16)"
    UNPACK=/tmp/pdflash-llamacpp/src
    if [[ "$(cat "$UNPACK/.tarball-id" 2>/dev/null || true)" != "$TAR_ID" || ! -f "$UNPACK/llama.cpp/CMakeLists.txt" ]]; then
        rm -rf "$UNPACK"; mkdir -p "$UNPACK"
        tar -xzf "$SRC" -C "$UNPACK" || die "cannot unpack $SRC"
        echo "$TAR_ID" > "$UNPACK/.tarball-id"
    fi
    SRC_DIR="$UNPACK/llama.cpp"
fi
[[ -f "$SRC_DIR/CMakeLists.txt" && -d "$SRC_DIR/gguf-py/gguf" ]] || die "$SRC_DIR is not a llama.cpp tree with gguf-py"
# what the build folder is kept for: this tree (CMake ties a build folder to one source folder) and its version
SRC_ID="$SRC_DIR|$({ cat "$SRC_DIR/PEER_SOURCE.json" 2>/dev/null || true; } | sha256sum | cut -c1-16)"
COMMIT="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("commit","unknown"))' "$SRC_DIR/PEER_SOURCE.json" 2>/dev/null || echo unknown)"
log "source $SRC_DIR (llama.cpp $COMMIT) ready in $(( $(now) - t ))s"

# GGUFs left in this script's own folders by a run killed before its cleanup (they would take the room)
if [[ "$KEEP_MODELS" != 1 ]]; then
    for d in /dev/shm/pdflash-llamacpp /tmp/pdflash-llamacpp/models; do
        rm -f "$d"/*.gguf "$d"/*.gguf.partial 2>/dev/null || true
    done
fi

# -- plans: shapes, sizes, default --n-cpu-moe lists (also validates --models before anything runs) --
PRESETS=(); ETYPES=(); DTYPES=(); TAGS=()
for m in ${MODELS//,/ }; do
    IFS=':' read -r p e d <<< "$m"
    args=(--preset "$p" --plan)
    if [[ -n "${e:-}" ]]; then args+=(--expert-type "$e"); fi
    if [[ -n "${d:-}" ]]; then args+=(--dense-type "$d"); fi
    "$PY" "$REPO/benchmarks/llamacpp_gguf.py" "${args[@]}" > "$WORK/plan.json" 2> "$WORK/plan.err" \
        || die "--models $m: $(tail -1 "$WORK/plan.err")"
    read -r e d < <("$PY" -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["expert_type"], j["dense_type"])' "$WORK/plan.json")
    tag="$p-$e"
    if [[ "$d" != bf16 ]]; then tag="$tag-$d"; fi
    mv "$WORK/plan.json" "$WORK/plan_$tag.json"
    PRESETS+=("$p"); ETYPES+=("$e"); DTYPES+=("$d"); TAGS+=("$tag")
done
[[ ${#PRESETS[@]} -gt 0 ]] || die "--models is empty"

plan_get() {  # tag, key
    "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$WORK/plan_$1.json" "$2"
}

ncmoe_list() {  # preset, tag -> the --n-cpu-moe values, comma separated, each once, checked
    local p="$1" L item items=() list=""
    L="$(plan_get "$2" n_layer)"
    if [[ -n "$NCMOE_SPEC" && "$NCMOE_SPEC" != *=* ]]; then
        list="$NCMOE_SPEC"
    elif [[ -n "$NCMOE_SPEC" ]]; then
        IFS=';' read -ra items <<< "$NCMOE_SPEC"
        for item in "${items[@]}"; do
            if [[ "${item%%=*}" == "$p" ]]; then list="${item#*=}"; fi
        done
    fi
    if [[ -z "$list" ]]; then list="0,$((L / 4)),$((L / 2)),$((3 * L / 4)),$L"; fi
    [[ "$list" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--ncmoe for $p: '$list' is not a comma-separated list of numbers"
    echo "$list" | tr ',' '\n' | awk '!seen[$0]++' | paste -sd, -
}

pick_model_dir() {  # bytes -> a folder with room for them + 1 GiB (nothing when none has)
    local need=$(( $1 + (1 << 30) )) d free cands=()
    if [[ -n "$MODEL_DIR" ]]; then cands=("$MODEL_DIR"); else cands=(/dev/shm/pdflash-llamacpp /tmp/pdflash-llamacpp/models); fi
    for d in "${cands[@]}"; do
        mkdir -p "$d" 2>/dev/null || continue
        free=$(( $(stat -f -c '%a * %S' "$d") ))
        if (( free >= need )); then echo "$d"; return; fi
        log "  $d: $((free >> 30)) GiB free, the GGUF needs $((need >> 30)) GiB"
    done
}

start_write() {  # model index, writer threads -> background writer; sets WRITER_PID, MODEL_FILE, WRITE_T0
    local i="$1" threads="$2" tag="${TAGS[$1]}" bytes dir
    bytes="$(plan_get "$tag" tensor_bytes)"
    dir="$(pick_model_dir "$bytes")"
    if [[ -z "$dir" ]]; then
        log "SKIP $tag: no folder with room for its $((bytes >> 30)) GiB GGUF"
        MODEL_FILE=""; WRITER_PID=""; return 1
    fi
    MODEL_FILE="$dir/$tag.gguf"
    MODELS_WRITTEN+=("$MODEL_FILE")
    WRITE_T0=$(now)
    log "writing $MODEL_FILE ($(( bytes >> 20 )) MiB, $threads threads) in the background"
    timeout -k 5 "$(tleft)" "$PY" "$REPO/benchmarks/llamacpp_gguf.py" --preset "${PRESETS[$i]}" \
        --expert-type "${ETYPES[$i]}" --dense-type "${DTYPES[$i]}" --out "$MODEL_FILE" --seed "$SEED" \
        --threads "$threads" --gguf-py "$SRC_DIR/gguf-py" \
        > "$WORK/write_$tag.json" 2> "$OUT_DIR/llamacpp_logs/write_$tag.log" &
    WRITER_PID=$!
}

wait_write() {  # tag -> 0 when the model file is complete
    local tag="$1" rc=0
    [[ -n "$WRITER_PID" ]] || return 1
    wait "$WRITER_PID" || rc=$?
    WRITER_PID=""
    if [[ $rc -ne 0 || ! -s "$WORK/write_$tag.json" ]]; then
        log "SKIP $tag: writing the GGUF failed (rc=$rc): $(tail -1 "$OUT_DIR/llamacpp_logs/write_$tag.log" 2>/dev/null)"
        rm -f "$MODEL_FILE" "$MODEL_FILE.partial"
        return 1
    fi
    log "$(tail -1 "$OUT_DIR/llamacpp_logs/write_$tag.log") (ready $(( $(now) - WRITE_T0 ))s after it started)"
}

# -- 2. the first GGUF in the background, the build meanwhile ---------------------------------------
# 2 writer threads while the build takes the cores (the build is the longer of the two)
FIRST_WRITER_STARTED=0
if start_write 0 $(( WRITE_THREADS < 2 ? WRITE_THREADS : 2 )); then FIRST_WRITER_STARTED=1; fi

BUILD_T0=$(now)
CMAKE_ARGS=()
NVCC_VERSION=none
BUILD_CACHED=0
if [[ -n "$BENCH_BIN" ]]; then
    [[ -x "$BENCH_BIN" ]] || die "--bench-bin $BENCH_BIN is not an executable"
    BENCH="$BENCH_BIN"
    BUILD_SECONDS=0
    BUILD_CACHED=1
    log "using $BENCH (no build)"
else
    CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
                -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMIT="$COMMIT")
    if [[ "$CPU_MODE" == 1 ]]; then
        CMAKE_ARGS+=(-DGGML_CUDA=OFF)
    else
        if ! command -v nvcc >/dev/null; then
            for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin /usr/local/cuda-13/bin /opt/cuda/bin; do
                if [[ -x "$d/nvcc" ]]; then export PATH="$d:$PATH"; break; fi
            done
        fi
        command -v nvcc >/dev/null || die "nvcc not found (PATH, /usr/local/cuda/bin); --cpu runs without CUDA"
        # FA kernels only for the f16 KV cache llama-bench uses (fewer template instances to compile)
        CMAKE_ARGS+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DGGML_CUDA_NCCL=OFF
                     -DGGML_CUDA_FA_QUANTS=f16-f16 -DCMAKE_CUDA_COMPILER="$(command -v nvcc)")
    fi
    BUILD_ID="$SRC_ID|$CPU_MODE|${CMAKE_ARGS[*]}"
    if [[ "$(cat "$BUILD_DIR/.pdflash-build-id" 2>/dev/null || true)" != "$BUILD_ID" ]]; then
        rm -rf "$BUILD_DIR"
    fi
    mkdir -p "$BUILD_DIR"
    if [[ -x "$BUILD_DIR/bin/llama-bench" ]]; then BUILD_CACHED=1; fi
    log "build in $BUILD_DIR (llama-bench already built there: $BUILD_CACHED): cmake ${CMAKE_ARGS[*]}"
    BUILD_OK=1
    {
        timeout -k 10 "$(tleft)" cmake -S "$SRC_DIR" -B "$BUILD_DIR" "${CMAKE_ARGS[@]}" &&
        timeout -k 10 "$(tleft)" cmake --build "$BUILD_DIR" --target llama-bench -j "$JOBS"
    } > "$OUT_DIR/llamacpp_logs/build.log" 2>&1 || BUILD_OK=0
    BUILD_SECONDS=$(( $(now) - BUILD_T0 ))
    echo "$BUILD_ID" > "$BUILD_DIR/.pdflash-build-id"
    BENCH="$BUILD_DIR/bin/llama-bench"
    if [[ "$CPU_MODE" != 1 ]]; then NVCC_VERSION="$(nvcc --version | tail -2 | tr '\n' ' ')"; fi
    if [[ $BUILD_OK != 1 || ! -x "$BENCH" ]]; then
        log "BUILD FAILED after ${BUILD_SECONDS}s ($(( $(remaining) ))s left of the deadline); last lines of llamacpp_logs/build.log:"
        tail -25 "$OUT_DIR/llamacpp_logs/build.log" | tee -a "$LOG" >&2
        "$PY" -c 'import json, sys
out, commit, sec, nvcc = sys.argv[1:5]
json.dump({"status": "build_failed", "llama_cpp_commit": commit, "build_seconds": int(sec), "nvcc": nvcc,
           "log": "llamacpp_logs/build.log"}, open(out, "w"), indent=1)' \
            "$OUT_DIR/llamacpp_build_failed.json" "$COMMIT" "$BUILD_SECONDS" "$NVCC_VERSION"
        exit 1
    fi
    log "built llama-bench in ${BUILD_SECONDS}s (nvcc: $NVCC_VERSION)"
fi
"$BENCH" --version > "$WORK/bench_version.txt" 2>&1 || true

GPU_INFO=""
if [[ "$HAVE_SMI" == 1 ]]; then
    GPU_INFO="$(nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader,nounits 2>&1 | head -8 || true)"
    log "GPU: $GPU_INFO"
fi

# -- 3. runs ----------------------------------------------------------------------------------------
# One light process samples every 0.2 s while llama-bench runs: the RSS of llama-bench (KiB: total anon
# file shmem) and the used memory of every GPU through NVML (libnvidia-ml, loaded once), falling back
# to one nvidia-smi call every 0.5 s when NVML cannot be loaded. Lines are flushed as written, so
# nothing is lost when the run ends; a light sampler leaves llama-bench's spinning threads undisturbed
# (the weights stay resident for the whole run, so the peak is held for seconds, not milliseconds).
SAMPLER_PY='
import ctypes, os, subprocess, sys, time
prefix, pid, have_smi = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
nvml = handles = None
try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    assert nvml.nvmlInit_v2() == 0
    count = ctypes.c_uint()
    assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
    handles = []
    for i in range(count.value):
        h = ctypes.c_void_p()
        assert nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0
        handles.append(h)
except Exception:
    nvml = None
class Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
def gpus():
    if nvml is not None:
        out = []
        for i, h in enumerate(handles):
            m = Mem()
            if nvml.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) == 0:
                out.append(f"{i}, {m.used >> 20}")
        return out
    if have_smi:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        return [l for l in r.stdout.splitlines() if l.strip()]
    return []
def children():
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []
with open(prefix + ".rss", "a") as frss, open(prefix + ".vram", "a") as fvram:
    fvram.write("# " + ("nvml" if nvml is not None else "nvidia-smi" if have_smi else "none") + "\n")
    while os.path.exists(f"/proc/{pid}"):
        for c in children():
            v = {}
            try:
                with open(f"/proc/{c}/status") as fh:
                    for line in fh:
                        k, _, rest = line.partition(":")
                        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                            v[k] = rest.split()[0]
            except OSError:
                continue
            if len(v) == 4:
                frss.write(" ".join(v[k] for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")) + "\n")
        for line in gpus():
            fvram.write(line + "\n")
        frss.flush(); fvram.flush()
        time.sleep(0.2 if nvml is not None or not have_smi else 0.5)
'
sampler() {  # out prefix, pid of `timeout` (llama-bench is its child)
    "$PY" -c "$SAMPLER_PY" "$1" "$2" "$HAVE_SMI" 2>> "$WORK/sampler.err" || true
}
gpu0_used() {
    if [[ "$HAVE_SMI" != 1 ]]; then echo; return; fi
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' ' || true
}

bench_once() {  # key, budget seconds, extra llama-bench args... -> rc; files under $WORK, log in OUT/llamacpp_logs
    local key="$1" budget="$2" rc=0 bpid n="${1##*_ncmoe}"
    shift 2
    : > "$WORK/mem_$key.rss"; : > "$WORK/mem_$key.vram"
    timeout -k 10 "$budget" "$BENCH" -m "$MODEL_FILE" -ngl 99 -ncmoe "$n" -p 0 -n "$NGEN" -r "$REPS" \
        -t "$THREADS" -fa 1 -o json -v "$@" > "$WORK/bench_$key.json" 2> "$OUT_DIR/llamacpp_logs/$key.log" &
    bpid=$!
    sampler "$WORK/mem_$key" "$bpid" &
    SAMPLER_PID=$!
    wait "$bpid" || rc=$?
    wait "$SAMPLER_PID" 2>/dev/null || true
    SAMPLER_PID=""
    return "$rc"
}

run_setting() {  # model index, ncmoe -> $WORK/{status,wall,host,avail,idle,mem,bench}_<key>
    local i="$1" n="$2" tag="${TAGS[$1]}" key budget rc=0 t el
    key="${tag}_ncmoe$n"
    local est=${LAST_SETTING_SECONDS:-45}
    budget=$(remaining)
    if (( budget < est + 10 )); then
        echo "skipped deadline: ${budget}s left, a run takes about ${est}s" > "$WORK/status_$key"
        log "SKIP $tag ncmoe=$n: ${budget}s left, a run takes about ${est}s"
        return
    fi
    local extra=() host="default (CUDA_Host pinned buffers for the CPU experts)" need avail no_host=0
    if [[ -n "$BENCH_ARGS" ]]; then read -ra extra <<< "$BENCH_ARGS"; fi
    avail=$(( $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) * 1024 ))
    if [[ "$CPU_MODE" == 1 ]]; then
        host="cpu build: no host buffer type"; no_host=1
    elif [[ " $BENCH_ARGS " == *" --no-host "* ]]; then
        host="as --bench-args say"; no_host=1
    else
        need=$(( $("$PY" -c 'import json,sys; g=json.load(open(sys.argv[1]))["gpu_weight_bytes_by_ncmoe"]; print(g["0"] - g[sys.argv[2]])' "$WORK/plan_$tag.json" "$n") + (6 << 30) ))
        if (( need > avail )); then
            extra+=(--no-host 1 --repack 0); no_host=1
            host="--no-host 1 --repack 0: MemAvailable $((avail >> 20)) MiB < CPU experts + 6 GiB = $((need >> 20)) MiB"
            log "  ncmoe=$n: $host"
        fi
    fi
    echo "$((avail >> 20))" > "$WORK/avail_$key"
    gpu0_used > "$WORK/idle_$key"
    t=$(now)
    bench_once "$key" "$((budget - 5))" "${extra[@]+"${extra[@]}"}" || rc=$?
    el=$(( $(now) - t ))
    if [[ $rc -ne 0 && $rc -ne 124 && $no_host == 0 && $n -gt 0 ]] && (( $(remaining) > el + 20 )); then
        # e.g. killed for memory while pinning the CPU experts: once more, reading them in place
        log "  ncmoe=$n: failed (rc=$rc) with pinned host buffers; once more with --no-host 1 --repack 0"
        mv "$OUT_DIR/llamacpp_logs/$key.log" "$OUT_DIR/llamacpp_logs/$key.first-try.log"
        host="--no-host 1 --repack 0 after a failed try with pinned host buffers (rc=$rc, llamacpp_logs/$key.first-try.log)"
        extra+=(--no-host 1 --repack 0)
        rc=0
        bench_once "$key" "$(( $(remaining) - 5 ))" "${extra[@]}" || rc=$?
        el=$(( $(now) - t ))
    fi
    echo "$host" > "$WORK/host_$key"
    echo "$el" > "$WORK/wall_$key"
    LAST_SETTING_SECONDS=$(( el + 5 ))
    if [[ $rc -eq 0 ]]; then
        echo "ok" > "$WORK/status_$key"
    elif [[ $rc -eq 124 ]]; then
        echo "timeout after ${el}s (deadline)" > "$WORK/status_$key"
    elif [[ $rc -eq 137 ]]; then
        echo "killed (SIGKILL, rc=137: the deadline's timeout -k or the OOM killer) after ${el}s" > "$WORK/status_$key"
    else
        echo "failed rc=$rc: $(grep -iE 'error|failed|out of memory' "$OUT_DIR/llamacpp_logs/$key.log" | tail -1)" > "$WORK/status_$key"
    fi
}

summarize() {  # model index, ncmoe list -> OUT/llamacpp_<preset>[_<types>].json + one line per value
    local i="$1"
    "$PY" - "${PRESETS[$i]}" "${ETYPES[$i]}" "${DTYPES[$i]}" "${TAGS[$i]}" "$MODEL_FILE" "$2" "$WORK" "$OUT_DIR" \
        "$CPU_MODE" "$COMMIT" "$BUILD_SECONDS" "$BUILD_CACHED" "$NVCC_VERSION" "$GPU_INFO" "$THREADS" "$NGEN" \
        "$REPS" "$CUDA_ARCH" "${CMAKE_ARGS[*]}" "$T0" "$BENCH_ARGS" <<'EOF'
import json, os, re, sys, time
(p, e, d, tag, f, nlist, work, out, cpu, commit, build_s, cached, nvcc, gpu, threads, ngen, reps, arch, cmake,
 t0, bench_args) = sys.argv[1:22]
cpu = cpu == "1"


def read(name, default=""):
    try:
        with open(os.path.join(work, name)) as fh:
            return fh.read()
    except OSError:
        return default


def num(s):
    s = (s or "").strip()
    return int(s) if s.isdigit() else None


plan = json.loads(read(f"plan_{tag}.json") or "{}")
try:
    write = json.loads(read(f"write_{tag}.json").strip().splitlines()[-1])
except (ValueError, IndexError):
    write = None
buf_re = re.compile(r"^\w+:\s+(\S+) (model|KV|compute|RS) buffer size =\s+([\d.]+) MiB", re.M)
settings = []
for n in [int(x) for x in nlist.split(",") if x.strip()]:
    key = f"{tag}_ncmoe{n}"
    status = read(f"status_{key}", "not run").strip() or "not run"
    rec = {"n_cpu_moe": n, "status": status, "host_buffers": read(f"host_{key}").strip() or None,
           "mem_available_before_mib": num(read(f"avail_{key}"))}
    raw = read(f"bench_{key}.json", None)
    if raw:
        try:
            rec["llama_bench"] = json.loads(raw)
        except ValueError:
            rec["llama_bench_raw"] = raw[-4000:]
    tg = [r for r in rec.get("llama_bench") or [] if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    rec["tokens_per_second"] = tg[0]["avg_ts"] if tg else None
    rec["tokens_per_second_stddev"] = tg[0].get("stddev_ts") if tg else None
    rss = [[int(x) for x in line.split()] for line in read(f"mem_{key}.rss").splitlines()
           if line.split() and all(x.isdigit() for x in line.split())]
    rss = [r for r in rss if len(r) == 4]
    rec["peak_rss_mib"] = round(max(r[0] for r in rss) / 1024, 1) if rss else None
    # at the VmRSS peak: anonymous (incl. llama.cpp's host copies), file-backed, shared memory (the /dev/shm GGUF)
    rec["rss_at_peak_mib"] = (dict(zip(("total", "anon", "file", "shmem"), (round(x / 1024, 1) for x in max(rss))))
                              if rss else None)
    per_gpu = {}
    vram_lines = read(f"mem_{key}.vram").splitlines()
    rec["vram_source"] = vram_lines[0][2:] if vram_lines and vram_lines[0].startswith("# ") else None
    for line in vram_lines:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            per_gpu.setdefault(parts[0], []).append(int(parts[1]))
    rec["vram_samples"] = sum(len(v) for v in per_gpu.values())
    rec["peak_vram_mib_by_gpu"] = {k: max(v) for k, v in per_gpu.items()} or None
    rec["peak_vram_mib"] = max(per_gpu["0"]) if "0" in per_gpu else None
    rec["idle_vram_mib"] = num(read(f"idle_{key}"))
    if rec["peak_vram_mib"] is not None and rec["idle_vram_mib"] is not None:
        rec["peak_vram_above_idle_mib"] = rec["peak_vram_mib"] - rec["idle_vram_mib"]
    log = ""
    try:
        with open(os.path.join(out, "llamacpp_logs", f"{key}.log")) as fh:
            log = fh.read()
    except OSError:
        pass
    bufs = {}
    for dev, kind, mib in buf_re.findall(log):
        bufs[f"{dev} {kind}"] = round(bufs.get(f"{dev} {kind}", 0.0) + float(mib), 2)
    rec["llama_cpp_buffers_mib"] = bufs
    rec["wall_seconds"] = num(read(f"wall_{key}"))
    gw = (plan.get("gpu_weight_bytes_by_ncmoe") or {}).get(str(n))
    rec["gpu_weight_mib_from_shapes"] = round(gw / 2**20, 1) if gw is not None else None
    settings.append(rec)
    tps = rec["tokens_per_second"]
    mem = (f"peak VRAM {rec['peak_vram_mib']} MiB (+{rec.get('peak_vram_above_idle_mib')} over idle), "
           if rec["peak_vram_mib"] is not None else "")
    print(f"llamacpp {tag} ncmoe={n}: " + (f"{tps:.2f} tok/s, " if tps else "") + mem +
          f"peak RSS {rec['peak_rss_mib']} MiB, weights for the GPU {rec['gpu_weight_mib_from_shapes']} MiB, "
          f"{rec['wall_seconds']}s, {status}", flush=True)
default_e = {"gpt_oss": "mxfp4", "qwen3_moe": "bf16"}.get(plan.get("family"))
name = f"llamacpp_{p}" + ("" if e == default_e else f"_{e}") + ("" if d == "bf16" else f"_dense-{d}") + ".json"
result = {
    "peer": "llama.cpp llama-bench --n-cpu-moe", "preset": p, "expert_type": e, "dense_type": d,
    "mode": "cpu" if cpu else "cuda",
    "command": f"llama-bench -m {os.path.basename(f) or '(not written)'} -ngl 99 -ncmoe N -p 0 -n {ngen} -r {reps} "
               f"-t {threads} -fa 1 -o json -v" + (f" {bench_args}" if bench_args else ""),
    "gguf": {"plan": plan, "write": write},
    "build": {"llama_cpp_commit": commit, "seconds": int(build_s), "llama_bench_existed_before": cached == "1",
              "nvcc": nvcc, "cuda_architectures": None if cpu else arch, "cmake_args": cmake,
              "llama_bench_version": read("bench_version.txt").strip()},
    "gpu": gpu or None,
    "settings": settings,
    "seconds_since_start": round(time.time() - int(t0), 1),
}
with open(os.path.join(out, name), "w") as fh:
    json.dump(result, fh, indent=1)
EOF
}

ANY_OK=0
for i in "${!PRESETS[@]}"; do
    p="${PRESETS[$i]}"; tag="${TAGS[$i]}"
    list="$(ncmoe_list "$p" "$tag")"
    if [[ $i -gt 0 || "$FIRST_WRITER_STARTED" != 1 ]]; then
        if [[ -n "$MODEL_FILE" && "$KEEP_MODELS" != 1 ]]; then rm -f "$MODEL_FILE"; fi
        MODEL_FILE=""
        # about size / 1 GB/s to write at worst, plus one run
        need=$(( $(plan_get "$tag" tensor_bytes) / 1000000000 + 60 ))
        if (( $(remaining) < need )); then
            log "SKIP $tag: about ${need}s needed to write and run it, $(remaining)s left"
            for n in ${list//,/ }; do echo "skipped deadline: not written" > "$WORK/status_${tag}_ncmoe$n"; done
            summarize "$i" "$list" | tee -a "$LOG"
            continue
        fi
        if ! start_write "$i" "$WRITE_THREADS"; then
            for n in ${list//,/ }; do echo "skipped: no room for the GGUF" > "$WORK/status_${tag}_ncmoe$n"; done
            summarize "$i" "$list" | tee -a "$LOG"
            continue
        fi
    fi
    if ! wait_write "$tag"; then
        for n in ${list//,/ }; do echo "skipped: GGUF not written" > "$WORK/status_${tag}_ncmoe$n"; done
        MODEL_FILE=""
        summarize "$i" "$list" | tee -a "$LOG"
        continue
    fi
    log "$tag: --n-cpu-moe $list"
    LAST_SETTING_SECONDS=""
    for n in ${list//,/ }; do
        run_setting "$i" "$n"
        if [[ "$(cat "$WORK/status_${tag}_ncmoe$n")" == ok ]]; then ANY_OK=1; fi
        log "  ncmoe=$n: $(cat "$WORK/status_${tag}_ncmoe$n") ($(cat "$WORK/wall_${tag}_ncmoe$n" 2>/dev/null || echo 0)s)"
    done
    summarize "$i" "$list" | tee -a "$LOG"
    if [[ "$KEEP_MODELS" != 1 ]]; then rm -f "$MODEL_FILE"; fi
done

log "done in $(( $(now) - T0 ))s; results in $OUT_DIR/llamacpp_*.json"
if [[ $ANY_OK != 1 ]]; then exit 1; fi
