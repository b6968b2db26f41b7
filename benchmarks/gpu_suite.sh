#!/usr/bin/env bash
# The GPU suite: build, GPU tests, benchmarks, in one call on the H200 (device tool).
#   bash benchmarks/gpu_suite.sh [stage ...]
#   stages: build tests gemm mma gemv attention sanitize profile moe ab switches act_gemv unrun unrun_perf
#   unrun_ab unrun_b16 verify18 unrun19 unrun19_e2e unrun22 unrun23 b64 s23 s24 s24q s24_e2e s26 s26_moe s27 s27b s28 s28m s28m_ab s28d s29 s29b s31 s34p s38 s38m s38b s39 s40 s41 s42 s43 s45 s48 s49 s51 s53 s56 s58 s59 s61 s62 s63 s64 s33 s28p moe_ncu targets targets11 targets12 wgmma_ws wgmma wgmma_auto wgmma_on wgmma_e2e wgmma_profile e2e quantize
#   (default: all but mma, profile, moe, ab, switches, act_gemv, verify18, targets, the wgmma ones and the unrun ones)
# Writes logs and JSON under $OUT (default ./out). Needs no network: installs with --no-deps.
# FASTAWQ_SUITE_INSTALL=copy skips the CMake build and runs the Python sources from a copy
# (Triton/torch backends only), for quick kernel iterations.
# One device call may run 10 minutes and each call on a cold machine spends ~1 min starting it
# (the machine goes back 30 s after a call): pack stages into few calls. Times seen on the H200:
# build 30-60 s; tests with FASTAWQ_SUITE_TESTS=tests/test_cuda_ops.py ~2 min, the
# whole suite > 6 min (split it); gemm ~1.5 min (Triton tunes each M bucket and shape on first
# use); gemv, attention, sanitize ~20-40 s each; quantize ~40 s; e2e ~2.5 min; profile (ncu) ~1 min.
set -uo pipefail
cd "$(dirname "$0")/.."
# The hash of what _C is built from (a prebuilt _C is used only where it matches).
sources_hash() { find csrc CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16; }
if [ "${1:-}" = --sources-hash ]; then sources_hash; exit 0; fi
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# Everything the suite prints goes to $OUT/0_suite.log as well: a device call brings back only the
# last 12,000 characters of its output and at most 8 files of $OUT, top-level ones first by name (in
# session 35 a call's tables were lost to both limits), so this one file always comes back.
exec > >(tee -a "$OUT/0_suite.log") 2>&1
export PYTHONUNBUFFERED=1
# The benchmarks' JSON records FASTAWQ_COMMIT as the tree's commit, else `git rev-parse HEAD`, which on
# the device machine reads its copy's git metadata, not the tree sent (session 41: 520bf92 recorded for
# c5cfdf8): pass FASTAWQ_COMMIT=$(git rev-parse --short HEAD) from this side in the device command.
if [ -z "${FASTAWQ_COMMIT:-}" ]; then
  echo "FASTAWQ_COMMIT unset: the JSON commit fields read this machine's git HEAD ($(git rev-parse --short HEAD 2>/dev/null))"
fi
stages=${*:-build tests gemm gemv attention sanitize e2e quantize}
status=0
step() { echo "=== $1 ($(date +%T))"; }
# pytest_gate LOG SECONDS ARGS...: pytest -x -v ARGS into LOG under a timeout; prints the counts and
# succeeds when some test passed and none failed. It reads the per-test lines, so a run cut by its
# timeout still gates on what ran.
pytest_gate() {
  local log=$1 secs=$2; shift 2
  timeout "$secs" python -m pytest -x -v -rf -p no:cacheprovider "$@" > "$log" 2>&1
  echo "$(grep -c " PASSED" "$log") passed, $(grep -cE " (FAILED|ERROR)" "$log") failed"
  grep -E " (FAILED|ERROR)" "$log" | head -5; tail -2 "$log"
  grep -q " PASSED" "$log" && ! grep -qE " (FAILED|ERROR)|[0-9]+ (failed|error)" "$log"
}

# c_throws [need]: a TORCH_CHECK thrown from _C reaches Python as a RuntimeError instead of crashing
# the interpreter (it did on the device image once: benchmarks/CUDA_NOTES.md, "Build facts"). With
# `need` (a prebuilt _C), _C must also load with awq_wgmma_packed and the call must throw.
c_throws() {
  python - "$@" <<'PY'
import sys, torch
from fastawq import _ext
need = "need" in sys.argv[1:]
if need and not _ext.has_op("awq_wgmma_packed"):
    sys.exit(1)
if _ext.has_op("awq_gemm"):
    qw = torch.zeros(256, 16, dtype=torch.int32, device="cuda")
    try:
        torch.ops.fastawq.awq_gemm(torch.ones(2, 256, device="cuda"), qw, torch.ones(4, 128, dtype=torch.float16,
                                   device="cuda"), torch.zeros(4, 16, dtype=torch.int32, device="cuda"), 64, None)
    except RuntimeError as e:
        print("throw ok:", str(e).splitlines()[0])
        sys.exit(0)
sys.exit(1 if need else 0)
PY
}

# table_by_env NAME "V1 V2 ..." PREFIX PATTERN ARGS...: benchmarks/gemm_table.py ARGS with NAME=V for
# each value in turn (the JSON under $OUT/PREFIX_V), printing each table's lines that match PATTERN.
table_by_env() {
  local name=$1 values=$2 prefix=$3 pattern=$4 v rc=0
  shift 4
  for v in $values; do
    echo "$name=$v"
    env "$name=$v" timeout 150 python benchmarks/gemm_table.py "$@" --out "$OUT/${prefix}_$v" 2>&1 \
      | grep -E "$pattern" || rc=1
  done
  return $rc
}

# memcheck_packed: compute-sanitizer's memcheck over the packed-layout kernels (their A/B switches'
# cases included), its last lines; fails on any error.
memcheck_packed() {
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only packed 2>&1 \
    | tail -2
}

# ncu_source NAME CMD...: Nsight Compute on awq_wgmma_packed while CMD runs: the stall reasons a
# issue, the source counters (sampled stalls, shared wavefronts a SASS instruction), the pipes' and
# memory tables; the details page grepped, the source page as $OUT/NAME.sass.csv ranked by
# benchmarks/ncu_stalls.py (the report itself is dropped: a device call brings back a few files only).
ncu_source() {
  local name=$1; shift
  local stalls=smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  local reason
  for reason in barrier wait short_scoreboard math_pipe_throttle mio_throttle lg_throttle membar not_selected selected; do
    stalls+=,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio
  done
  timeout 150 ncu --clock-control none --kernel-name regex:awq_wgmma_packed --section WarpStateStats \
    --section SourceCounters --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --metrics "$stalls" -f -o "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 \
    || { status=1; tail -5 "$OUT/$name.log"; }
  [[ -f "$OUT/$name.ncu-rep" ]] || return 0
  ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
  grep -E "stalled|Warp Cycles Per Issued|Duration|DRAM Throughput|excessive|Pipe|Issue Slots|Executed Ipc" \
    "$OUT/$name.txt" | head -40
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>&1 \
    || head -3 "$OUT/$name.sass.csv"
  python benchmarks/ncu_stalls.py "$OUT/$name.sass.csv" --top 15 || status=1
  rm -f "$OUT/$name.ncu-rep"
}

if [[ " $stages " == *" build "* ]]; then
  step build
  if [ "${FASTAWQ_SUITE_INSTALL:-pip}" = copy ]; then
    rm -rf /tmp/fastawq_src && mkdir -p /tmp/fastawq_src && cp -r python/fastawq /tmp/fastawq_src/ \
      && cp -r triton_kernels /tmp/fastawq_src/fastawq/triton_kernels
    export PYTHONPATH=/tmp/fastawq_src
  else
    # The device image may lack scikit-build-core: build _C with CMake directly and lay the
    # package out as the wheel would (sources + _C + _build_info) on PYTHONPATH.
    export FASTAWQ_CUDA_ARCHS=${FASTAWQ_CUDA_ARCHS:-9.0a} FASTAWQ_BUILD_KERNELS=on
    # The image's default $CXX builds a _C whose exceptions crash (benchmarks/CUDA_NOTES.md).
    [[ -x /usr/bin/g++ ]] && export FASTAWQ_HOST_CXX=${FASTAWQ_HOST_CXX:-/usr/bin/g++}
    bdir=build/suite
    rm -rf /tmp/fastawq_src && mkdir -p /tmp/fastawq_src && cp -r python/fastawq /tmp/fastawq_src/ \
      && cp -r triton_kernels /tmp/fastawq_src/fastawq/triton_kernels
    export PYTHONPATH=/tmp/fastawq_src
    # A _C built elsewhere against this very torch (`carry` build/prebuilt: scripts/prebuild_suite.sh)
    # spares a cold machine the ~2 min build; used only where it loads and holds the ops, else built.
    pre=build/prebuilt
    if [ -f "$pre/_C.so" ] && [ -f "$pre/_build_info.py" ]; then
      if [ "$(cat "$pre/SOURCES" 2>/dev/null)" != "$(sources_hash)" ]; then
        echo "build: the prebuilt _C was built from other sources; building"
      else
        cp "$pre/_C.so" "$pre/_build_info.py" /tmp/fastawq_src/fastawq/
        # It must load, hold the ops and let a TORCH_CHECK reach Python (c_throws).
        if c_throws need > "$OUT/prebuilt.log" 2>&1; then
          echo "build: the prebuilt _C ($(sed -n 's/^TORCH_VERSION = //p' "$pre/_build_info.py"))"
        else
          echo "build: the prebuilt _C does not load here ($(tail -c 300 "$OUT/prebuilt.log")); building"
          rm -f /tmp/fastawq_src/fastawq/_C*.so /tmp/fastawq_src/fastawq/_build_info.py
        fi
      fi
    fi
    if [ ! -f /tmp/fastawq_src/fastawq/_build_info.py ]; then
      { cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python)" \
          && cmake --build "$bdir" -j "$(nproc)"; } > "$OUT/build.log" 2>&1 \
        || { echo "build failed"; grep -E -A5 "error|Error" "$OUT/build.log" | head -60; exit 1; }
      cp "$bdir"/_C*.so "$bdir"/_build_info.py /tmp/fastawq_src/fastawq/
    fi
  fi
  python -m fastawq env | tee "$OUT/env.txt"
  c_throws || { echo "a C++ exception from _C crashed the interpreter"; exit 2; }
elif ! python -c "import fastawq" 2>/dev/null; then
  # `build` lays the package out on PYTHONPATH for this call only (the machine keeps the CMake
  # build between calls, so a warm `build` takes seconds): without it every stage would fail.
  echo "fastawq is not importable: name the build stage first (gpu_suite.sh build $stages)"; exit 1
fi
if [[ " $stages " == *" tests "* ]]; then
  step tests
  # -v: every test's name and result reach tests.log as they finish, so a call cut short by its
  # time limit still says which test failed (-q's dots did not).
  python -m pytest -v -rf -p no:cacheprovider -p no:logging ${FASTAWQ_SUITE_TESTS:-tests} -m "not slow" 2>&1 \
    | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" | tail -25 || status=1
fi
if [[ " $stages " == *" gemm "* ]]; then
  step gemm
  python benchmarks/gemm_table.py --out "$OUT" ${FASTAWQ_SUITE_GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm_table.md" || status=1
fi
if [[ " $stages " == *" mma "* ]]; then
  step mma
  # The packed layout's compiled kernels forced, and tiles of the tensor-core one
  # (mma:CHUNKS:WARPS_PER_SM, 0 = what fits), against cuBLAS: ~1.5 min.
  python benchmarks/gemm_table.py --kernels gemv,mma,mma:4:0,mma:2:0,mma:1:0,mma:2:8 --ms 1,2,4,8,12,16,32 \
    --out "$OUT/mma" 2>&1 | tee "$OUT/mma_sweep.md" | grep -A12 "^| dtype" || status=1
fi
if [[ " $stages " == *" gemv "* ]]; then
  step gemv
  python benchmarks/bench_cuda.py --ms 1,2 --variants gemv,gemv_staged,mma --json "$OUT/bench_gemv.json" 2>&1 \
    | tee "$OUT/bench_gemv.txt" | tail -12 || status=1
fi
if [[ " $stages " == *" attention "* ]]; then
  step attention
  python benchmarks/bench_attention.py --out "$OUT" 2>&1 | tail -12 || status=1
fi
if [[ " $stages " == *" sanitize "* ]]; then
  step sanitize
  compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -4 || status=1
fi
if [[ " $stages " == *" profile "* ]]; then
  step profile
  ncu --clock-control none --kernel-name regex:awq_gemv --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats python benchmarks/profile_gemv.py \
    > "$OUT/ncu_gemv.txt" 2>&1 || status=1
  grep -E "awq_gemv|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued" "$OUT/ncu_gemv.txt" | head -40
fi
if [[ " $stages " == *" moe "* ]]; then
  step moe
  # The grouped MoE op on both GPU backends, then fused decode of the two MoE shapes at full depth
  # (all layers built: ~20 s each), heuristic Triton configs: ~4 min.
  python benchmarks/bench_moe.py --no-tune --backends triton,cuda --out "$OUT/moe" 2>&1 | tail -12 || status=1
  for shape in qwen3-30b-a3b mixtral-8x7b; do
    FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_e2e.py --shape $shape --batches 1,16 --modes fused-graphs \
      --graph-lengths 64 --max-seq-len 256 --budget 30 --out "$OUT/e2e_$shape" 2>&1 | grep -E "^\| fused|wall|us " || status=1
  done
fi
if [[ " $stages " == *" ab "* ]]; then
  step ab
  # One switch off and on, on one built model (benchmarks/bench_ab.py): PDL and the W4 layout
  # (awq vs packed, which the fused engine gets up to batch 16) on the Llama shape; the attention
  # projections' layout on Qwen3-30B-A3B (all layers): ~4 min.
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare pdl --shape llama-3-8b --layout packed \
    --batches 1,16 --out "$OUT/ab" 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare layout --shape llama-3-8b --batches 4,8,16 \
    --out "$OUT/ab" 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare layout --shape qwen3-30b-a3b --batches 1,16 \
    --rounds 1 --decode 64 --out "$OUT/ab" 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" switches "* ]]; then
  step switches
  # The compiled kernels' A/B switches (benchmarks/CUDA_NOTES.md): the kernels behind the non-default
  # settings against the reference, then what each setting buys in decode, A/B in one process
  # (bench_ab.py --compare env:NAME=OFF,ON): ~5 min.
  python -m pytest -q -p no:cacheprovider tests/test_moe_op.py -k route 2>&1 | tail -1 || status=1
  for env in FASTAWQ_ATTN_PREFETCH=0 FASTAWQ_ATTN_SPLIT_KEYS=128 FASTAWQ_ROUTE_LATE_TRIGGER=1; do
    env $env python -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py tests/test_moe_op.py -k "attention or route" 2>&1 \
      | tail -1 | sed "s/^/$env: /" || status=1
  done
  for sw in FASTAWQ_ATTN_PREFETCH=0,1 FASTAWQ_ATTN_SPLIT_KEYS=64,128; do
    python benchmarks/bench_ab.py --compare env:$sw --shape qwen3-30b-a3b --batches 1 --layout packed --decode 64 \
      --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  done
fi
if [[ " $stages " == *" act_gemv "* ]]; then
  step act_gemv
  # awq_gemv_packed_act / _norm against the reference, then act_mul inside down_proj's GEMV and
  # add + RMSNorm inside QKV / gate_up's, each A/B in one process (~5 min).
  python -m pytest -q -p no:cacheprovider tests/test_gemv_packed.py -k "act or norm or prologue" 2>&1 | tail -1 || status=1
  for sw in act_gemv norm_gemv; do
    FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare $sw --shape llama-3-8b --batches 1,2 \
      --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  done
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare norm_gemv --shape qwen3-30b-a3b --batches 1 \
    --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" unrun "* ]]; then
  step unrun
  # Session 16's work that no GPU has run yet (CUDA_NOTES.md, session 16): its tests and sanitizer
  # runs here (~6 min), its kernels timed in unrun_perf, its decode A/Bs in unrun_ab:
  # awq_gemv_packed_norm's one-round-trip staging (main); on branch wip/session17-unrun also the
  # engine's own stream, moe_mma's batched id scans (tests with 2,400 / 4,096 ids) and the decode
  # attention's next-tile L1 prefetch (swept over FASTAWQ_ATTN_SPLIT_KEYS).
  # (-k applies to every file of a command: the filtered file runs alone.)
  python -m pytest -q -p no:cacheprovider tests/test_gemv_packed.py -k "act or norm or prologue" 2>&1 | tail -2 || status=1
  python -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_moe_mma.py tests/test_cuda_attention.py 2>&1 \
    | tail -2 || status=1
  python -m pytest -q -p no:cacheprovider tests/test_gemm_packed.py tests/test_gemv_packed.py tests/test_mma_packed.py \
    tests/test_moe_op.py -k "x_modes or early or staged or pingpong or deferred" \
    2>&1 | tail -2 || status=1
  compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 || status=1
  FASTAWQ_GEMM_SHARE_X=1 FASTAWQ_GEMV_EARLY_LOADS=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python benchmarks/sanitize.py 2>&1 | tail -2 || status=1
  # Session 17: awq_gemm_packed with x staged once a block in the mma's A order (FASTAWQ_GEMM_STAGE_X=1),
  # the decode attention's splits combining in distributed shared memory (FASTAWQ_ATTN_CLUSTER=1; its
  # tests run in test_cuda_attention.py above).
  FASTAWQ_GEMM_STAGE_X=1 FASTAWQ_GEMV_EARLY_LOADS=1 FASTAWQ_ATTN_CLUSTER=1 FASTAWQ_GEMV_PINGPONG=1 FASTAWQ_MMA_DEFER=1 \
    compute-sanitizer --tool memcheck \
    --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 || status=1
fi
if [[ " $stages " == *" unrun_perf "* ]]; then
  step unrun_perf
  # The kernels of the unrun stage timed (~5 min).
  python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 16,256 --backends cuda --no-tune 2>&1 | tail -6 || status=1
  echo "FASTAWQ_ATTN_CLUSTER=1"
  FASTAWQ_ATTN_CLUSTER=1 python benchmarks/bench_attention.py --heads 32,4 --lens 64,128,256,512,1024 \
    --capacity 4096 2>&1 | tail -6 || status=1
  for keys in 64 128 256; do
    echo "FASTAWQ_ATTN_SPLIT_KEYS=$keys"
    FASTAWQ_ATTN_SPLIT_KEYS=$keys python benchmarks/bench_attention.py --heads 32,4 --lens 128,256,512 \
      --capacity 4096 2>&1 | tail -5 || status=1
  done
  # The decode GEMV's two-batch loop and awq_mma_packed's deferred refills (session 17), each against
  # the current form: M = 1, 2 (GEMV) and 2, 4, 8 (mma, its register ring).
  for on in 0 1; do
    FASTAWQ_GEMV_PINGPONG=$on FASTAWQ_MMA_DEFER=$on python benchmarks/gemm_table.py --kernels gemv,mma \
      --ms 1,2,4,8 --dtypes float16,bfloat16 2>&1 | tail -6 || status=1
  done
  # awq_gemm_packed (1.14x at M = 16 in session 14) against awq_mma_packed, which M = 9..16 now gets,
  # then awq_gemm_packed with the block-shared x ring (FASTAWQ_GEMM_SHARE_X=1).
  python benchmarks/gemm_table.py --kernels mma,gemm --ms 12,16,32,64 --dtypes float16,bfloat16 2>&1 | tail -10 || status=1
  FASTAWQ_GEMM_SHARE_X=1 python benchmarks/gemm_table.py --kernels gemm --ms 12,16,32,64 --dtypes float16,bfloat16 \
    2>&1 | tail -10 || status=1
  # x staged once a block in the mma's A order (session 17; SASS: 130 / 149 / 166 instructions a step at
  # 1 / 2 / 4 m-tiles against 154 / 217 / 304), without and with the weights' ring filled before the
  # PDL wait, and its tiles at M = 32 / 64.
  for early in 0 1; do
    FASTAWQ_GEMM_STAGE_X=1 FASTAWQ_GEMV_EARLY_LOADS=$early python benchmarks/gemm_table.py --kernels gemm \
      --ms 12,16,32,64,128 --dtypes float16,bfloat16 2>&1 | tail -12 || status=1
  done
  FASTAWQ_GEMM_STAGE_X=1 python benchmarks/gemm_table.py --kernels gemm:1:1:0,gemm:1:2:0,gemm:2:1:0,gemm:2:2:0,gemm:4:1:0 \
    --ms 16,32,64 --dtypes float16 2>&1 | tail -5 || status=1
  # Qwen3-30B-A3B's attention projections at batch 16 took 11.3 / 11.4 us in the step (session 15)
  # for 5.2 / 4.2 MB: awq_mma_packed's plan there is 8 warps an SM (default_warps_per_sm), ~8-10 in
  # all on these shapes. Its tile and warp target against awq_gemm_packed, own and shared ring.
  python benchmarks/gemm_table.py --shapes 2048x5120,4096x2048 --kernels mma,mma:2:16,mma:2:0,mma:1:16,gemm \
    --ms 16 2>&1 | tail -6 || status=1
  FASTAWQ_GEMM_SHARE_X=1 python benchmarks/gemm_table.py --shapes 2048x5120,4096x2048 --kernels gemm --ms 16 \
    2>&1 | tail -6 || status=1
  FASTAWQ_GEMM_STAGE_X=1 python benchmarks/gemm_table.py --shapes 2048x5120,4096x2048 --kernels gemm --ms 16 \
    2>&1 | tail -6 || status=1
fi
if [[ " $stages " == *" unrun_ab "* ]]; then
  step unrun_ab
  # What the batch-1 switches buy in decode, each A/B'd in turn on one model a shape (bench_ab.py
  # --compare repeated): session 17's two-batch GEMV loop (loads in flight while a warp sums),
  # session 16's norm prologue and early weight loads, session 17's whole-range L2 prefetch of the
  # layers up to 24 MB and the attention's cluster combine. ~6 min.
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare env:FASTAWQ_GEMV_PINGPONG=0,1 --compare norm_gemv \
    --compare env:FASTAWQ_GEMV_EARLY_LOADS=0,1 --compare env:FASTAWQ_GEMV_PREFETCH=2,64 \
    --compare env:FASTAWQ_ATTN_CLUSTER=0,1 --shape llama-3-8b --batches 1,2 \
    --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare env:FASTAWQ_MMA_DEFER=0,1 --shape llama-3-8b \
    --batches 4,8 \
    --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare env:FASTAWQ_GEMV_PINGPONG=0,1 --compare norm_gemv \
    --compare env:FASTAWQ_GEMV_EARLY_LOADS=0,1 --compare env:FASTAWQ_GEMV_PREFETCH=2,64 \
    --compare env:FASTAWQ_ATTN_CLUSTER=0,1 --shape qwen3-30b-a3b --batches 1 \
    --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" unrun_b16 "* ]]; then
  step unrun_b16
  # awq_gemm_packed for batches of 9-16 in decode (bench_ab.py --compare gemm16), then the engine's
  # memory at max_seq_len 4096 (the 6.0 GiB target; the branch's own stream): ~4 min.
  # gemm16's "on" runs awq_gemm_packed in its ring form, gemm16_staged's in its staged-x form
  # (session 17), each against awq_mma_packed, on one model a shape.
  for shape in llama-3-8b qwen3-30b-a3b; do
    FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_ab.py --compare gemm16 --compare gemm16_staged \
      --compare gemm16_staged_early \
      --shape $shape --batches 16 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  done
  FASTAWQ_TRITON_TUNE=0 python benchmarks/bench_e2e.py --shape llama-3-8b --layout packed --modes fused-graphs \
    --graph-lengths 64 --batches 1 --max-seq-len 4096 --budget 60 --out "$OUT/e2e_memory" 2>&1 | tail -4 || status=1
fi
if [[ " $stages " == *" verify18 "* ]]; then
  step verify18
  # The session-18 defaults (2b75c9f) together, never run as one tree: each came from its own A/B
  # (RESULTS.md session 18). In priority order, each bounded, ~6 min: the engine's memory at
  # max_seq_len 4096 (target 6.0 GiB; the engine's own stream), the GPU tests of what the defaults
  # route through (three test fixes of 2b75c9f among them), T = 256 MoE (target 1.5x), decode with
  # the session-17 defaults against the session-18 ones, memcheck.
  FASTAWQ_TRITON_TUNE=0 timeout 90 python benchmarks/bench_e2e.py --shape llama-3-8b --layout packed \
    --modes fused-graphs --graph-lengths 64 --batches 1 --max-seq-len 4096 --budget 40 --out "$OUT/e2e_memory" \
    2>&1 | tail -4 || status=1
  timeout 150 python -m pytest -p no:cacheprovider -q --tb=short -rf tests/test_gemv_packed.py \
    tests/test_mma_packed.py tests/test_gemm_packed.py tests/test_cuda_attention.py tests/test_fused.py \
    > "$OUT/verify18_tests.txt" 2>&1 || status=1
  grep -E "^FAILED|passed|failed" "$OUT/verify18_tests.txt" | head -20 | cut -c1-300
  timeout 60 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 256 --backends cuda --no-tune 2>&1 \
    | tail -4 || status=1
  for shape in llama-3-8b qwen3-30b-a3b; do
    FASTAWQ_TRITON_TUNE=0 timeout 120 python benchmarks/bench_ab.py --compare defaults18 --shape $shape \
      --batches 1,16 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  done
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 \
    || status=1
fi
if [[ " $stages " == *" unrun19 "* ]]; then
  step unrun19
  # Session 19's switches on main, not yet run on a GPU (CUDA_NOTES.md, session 19), ~8 min: the MoE
  # decode kernel's w13 split sums handed to w2 (FASTAWQ_MOE_H_PARTIALS=1), the MoE block's output
  # handed to the next add_rms_norm as fp32 sums (FASTAWQ_MOE_SUMS=1), and the dense layer's o_proj
  # and down projection doing the same (FASTAWQ_DENSE_SUMS=1): tests, memcheck, A/Bs.
  python -m pytest -q -p no:cacheprovider tests/test_moe_op.py -k "partials or without_early_loads or sums" 2>&1 \
    | tail -2 || status=1
  python -m pytest -q -p no:cacheprovider tests/test_fused_moe.py tests/test_layer_ops.py 2>&1 | tail -2 || status=1
  python -m pytest -q -p no:cacheprovider tests/test_gemv_packed.py -k sums 2>&1 | tail -2 || status=1
  python -m pytest -q -p no:cacheprovider tests/test_fused.py -k "dense_sums or cuda_graph" 2>&1 | tail -2 || status=1
  FASTAWQ_MOE_H_PARTIALS=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py \
    2>&1 | tail -2 || status=1
  for p in 0 1; do
    echo "FASTAWQ_MOE_H_PARTIALS=$p"
    FASTAWQ_MOE_H_PARTIALS=$p python benchmarks/bench_moe.py --ts 1 --backends cuda --no-tune 2>&1 | tail -4 || status=1
  done
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_H_PARTIALS=0,1 \
    --compare env:FASTAWQ_MOE_SUMS=0,1 --shape qwen3-30b-a3b --batches 1 --layout packed --decode 64 --rounds 2 2>&1 \
    | grep -E "^\||on / off" || status=1
  FASTAWQ_MOE_H_PARTIALS=1 FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py \
    --compare env:FASTAWQ_MOE_SUMS=0,1 --shape qwen3-30b-a3b --batches 1 --layout packed --decode 64 --rounds 2 2>&1 \
    | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_SUMS=0,1 \
    --shape mixtral-8x7b --batches 1 --layout packed --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_DENSE_SUMS=0,1 \
    --shape llama-3-8b --batches 1,2 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" unrun19_e2e "* ]]; then
  step unrun19_e2e
  # Two engine rows of issue 11 not measured since session 3 (~4 min): prefill 2048 against fp16 on
  # the packed layout the engine now takes, and batch-64 decode.
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_e2e.py --shape llama-3-8b --layout packed \
    --modes fused-graphs,fp16 --graph-lengths 2048 --other-len 2048 --batches 1 --budget 150 --out "$OUT/e2e_prefill" \
    2>&1 | tail -6 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 120 python benchmarks/bench_e2e.py --shape llama-3-8b --modes fused-graphs \
    --graph-lengths 64 --batches 64 --budget 90 --out "$OUT/e2e_b64" 2>&1 | tail -4 || status=1
fi
if [[ " $stages " == *" wgmma "* ]]; then
  step wgmma
  # awq_wgmma_packed (sm_90a warpgroup MMA, session 20), ~4 min: its tests up to the first failure,
  # the kernel table against cuBLAS and awq_gemm_packed at M >= 16, memcheck.
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py 2>&1 | tail -15 || status=1
  timeout 90 python -m pytest -q -p no:cacheprovider tests/test_fused.py -k wgmma 2>&1 | tail -2 || status=1
  timeout 150 python benchmarks/gemm_table.py --kernels wgmma,wgmma:64:0,wgmma:128:0,gemm --dtypes float16,bfloat16 \
    --ms 16,32,64,128,256,1024,4096 --out "$OUT/wgmma" 2>&1 | grep -A30 "^| dtype" || status=1
  for sw in DEPTH=4 DEPTH=8 WARPGROUPS=1; do  # the ring's depth (default 6), one-warpgroup blocks (default 2)
    env FASTAWQ_WGMMA_$sw timeout 60 python benchmarks/gemm_table.py --kernels wgmma --ms 32,64,256,4096 \
      --out "$OUT/wgmma_$sw" 2>&1 | grep -A6 "^| dtype" | sed "s/^/$sw /" || status=1
  done
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 \
    || status=1
fi
if [[ " $stages " == *" wgmma_profile "* ]]; then
  step wgmma_profile
  # Nsight Compute on awq_wgmma_packed at M = 64 and 4096 on two Llama-3-8B shapes (~1.5 min): where a
  # step's time goes (tensor pipe busy, stall reasons, occupancy).
  timeout 150 ncu --clock-control none --kernel-name regex:awq_wgmma_packed --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
    python benchmarks/profile_gemm_packed.py --kernel wgmma --ms 64,4096 > "$OUT/ncu_wgmma.txt" 2>&1 || status=1
  grep -E "awq_wgmma|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Warp Cycles Per Issued|Registers" \
    "$OUT/ncu_wgmma.txt" | head -40
fi
if [[ " $stages " == *" wgmma_auto "* ]]; then
  step wgmma_auto
  # Whether awq_wgmma_packed should take M = 17..128 from Triton (session 21, ~6 min): the kernel table
  # against the automatic choice on both layouts (Triton there, tuned), then the engine at batch
  # 32 / 64 / 128 with it against Triton (bench_ab.py --compare wgmma), same run.
  timeout 200 python benchmarks/gemm_table.py --layouts awq,packed --kernels wgmma --dtypes float16,bfloat16 \
    --ms 32,48,64,96,128,256 --out "$OUT/wgmma_auto" 2>&1 | grep -A16 "^| dtype" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 240 python benchmarks/bench_ab.py --compare wgmma --shape llama-3-8b \
    --batches 32,64,128 --layout packed --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" wgmma_on "* ]]; then
  step wgmma_on
  # awq_wgmma_packed in the automatic choice for M = 17..32 (session 21), ~4 min: the dispatch and engine
  # tests, then the old default against the new at batch 24 / 32: the AWQ layout with Triton (tuned)
  # against the packed layout with awq_wgmma_packed (bench_ab.py --compare layout).
  timeout 240 python -m pytest -q -p no:cacheprovider tests/test_wgmma_packed.py tests/test_packed_layout.py \
    tests/test_fused.py -k "dispatch or switched or layout or wgmma or cuda_graph" 2>&1 | tail -2 || status=1
  timeout 200 python benchmarks/bench_ab.py --compare layout --shape llama-3-8b --batches 24,32 --decode 64 \
    --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" wgmma_e2e "* ]]; then
  step wgmma_e2e
  # awq_wgmma_packed in the fused engine (~6 min): batch 32 and 64 decode with it above the
  # compiled buckets against Triton there (backend.PACKED_WGMMA), packed layout; prefill 2048 with it.
  FASTAWQ_TRITON_TUNE=0 timeout 220 python benchmarks/bench_ab.py --compare wgmma --shape llama-3-8b --batches 32,64 \
    --layout packed --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
  # Prefill 2048 on the packed layout with it (every GEMM of the prompt above the buckets) against fp16.
  FASTAWQ_PACKED_WGMMA=1 FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_e2e.py --shape llama-3-8b \
    --layout packed --modes fused-graphs,fp16 --graph-lengths 2048 --other-len 2048 --batches 1 --budget 150 \
    --out "$OUT/e2e_prefill_wgmma" 2>&1 | tail -6 || status=1
fi
if [[ " $stages " == *" unrun22 "* ]]; then
  step unrun22
  # Session 22's changes no GPU has run (CUDA_NOTES.md session 22), ~7 min: gate_up's end handed
  # to the down projection as fp32 sums (FASTAWQ_DENSE_GU_SUMS=1, off), an MoE layer's o_proj handed
  # to the compiled router as fp32 sums (FASTAWQ_MOE_O_SUMS=1, off) and awq_wgmma_packed's
  # one-warpgroup blocks at the 32-token tile (the new default): tests, memcheck, A/Bs.
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gemv_packed.py -k sums 2>&1 | tail -2 || status=1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_moe_op.py -k "fp32_sums or compiled_route" 2>&1 \
    | tail -2 || status=1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k "sums" 2>&1 | tail -2 || status=1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_fused.py -k "dense_sums or dense_gu_sums" 2>&1 \
    | tail -2 || status=1
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_wgmma_packed.py -k "warpgroup or llama or dispatch" \
    2>&1 | tail -2 || status=1
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 \
    || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:FASTAWQ_DENSE_GU_SUMS=0,1 \
    --shape llama-3-8b --batches 1,2 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 180 python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_O_SUMS=0,1 \
    --shape qwen3-30b-a3b --batches 1,2 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  timeout 90 python benchmarks/gemm_table.py --kernels wgmma --ms 17,24,32 --out "$OUT/wgmma_wg" 2>&1 \
    | grep -A8 "^| dtype" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_WARPGROUPS=2,1 \
    --shape llama-3-8b --batches 24,32 --layout packed --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" wgmma_ws "* ]]; then
  step wgmma_ws
  # awq_wgmma_packed's warp-specialized form (FASTAWQ_WGMMA_FORM=ws, session 22, never run), ~5 min:
  # its tests up to the first failure (each bounded: an mbarrier protocol error hangs, it does not
  # fail), memcheck, then the kernel table against the session-21 form and cuBLAS in one run.
  FASTAWQ_WGMMA_FORM=ws timeout 60 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py \
    -k "warp_specialized_every" 2>&1 | tail -6 || status=1
  timeout 150 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py -k "warp_specialized" 2>&1 \
    | tail -6 || status=1
  FASTAWQ_WGMMA_FORM=ws timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py \
    2>&1 | tail -3 || status=1
  timeout 200 python benchmarks/gemm_table.py --kernels wgmmaplain,wgmmaws --dtypes float16,bfloat16 \
    --ms 32,64,128,256,1024,4096 --out "$OUT/wgmma_ws" 2>&1 | grep -A16 "^| dtype" || status=1
fi
if [[ " $stages " == *" unrun23 "* ]]; then
  step unrun23
  # Session 23's QKV handoff (FASTAWQ_QKV_SUMS=1, off; first run in session 26, whose fixed tests
  # and A/Bs `s26` / `s26_moe` now take), ~5 min: the rope attention on fp32
  # qkv sums (exact against qkv rounded first), the engine tests, memcheck, then A/Bs at batch 1 / 2
  # (Qwen3 with FASTAWQ_MOE_O_SUMS=1 in both arms: its attention takes the sums path only there).
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py -k "fp32" 2>&1 | tail -2 \
    || status=1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_fused.py -k "qkv_sums" 2>&1 | tail -2 || status=1
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 \
    || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:FASTAWQ_QKV_SUMS=0,1 \
    --shape llama-3-8b --batches 1,2 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  FASTAWQ_MOE_O_SUMS=1 FASTAWQ_TRITON_TUNE=0 timeout 180 python benchmarks/bench_ab.py \
    --compare env:FASTAWQ_QKV_SUMS=0,1 --shape qwen3-30b-a3b --batches 1 --layout packed --decode 64 --rounds 2 \
    2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" b64 "* ]]; then
  step b64
  # Issue 11's batch-64 row (16,000 tok/s; the engine takes the AWQ layout above batch 32): the
  # packed layout with awq_wgmma_packed at M = 64 in each form against Triton on it, and the two
  # layouts as the engine runs them now, ~4 min. A win moves PACKED_WGMMA_MAX_M (backend.py).
  for form in 0 ws; do
    FASTAWQ_WGMMA_FORM=$form FASTAWQ_TRITON_TUNE=0 timeout 120 python benchmarks/bench_ab.py --compare wgmma \
      --shape llama-3-8b --batches 64 --layout packed --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
  done
  FASTAWQ_TRITON_TUNE=0 timeout 120 python benchmarks/bench_ab.py --compare layout --shape llama-3-8b --batches 64 \
    --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" moe_ncu "* ]]; then
  step moe_ncu
  # Issue 12's batch-16 row: moe_mma_w4's two launches at Qwen3-30B-A3B, T = 16 (CUDA_NOTES.md
  # session 22's grid arithmetic: is a busy block's fixed part or the wave tail what costs?), ~1 min.
  # PROFILE_MOE_LAYOUT=packed (passed through) profiles moe_mma_packed_w4 instead: the layout the
  # fused engine's experts take at batch sizes above 1 (backend.experts_layout).
  PROFILE_MOE_SHAPES=qwen3-30b-a3b timeout 150 ncu --clock-control none --kernel-name regex:moe_mma \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum \
    python benchmarks/profile_moe.py \
    > "$OUT/ncu_moe.txt" 2>&1 || status=1
  grep -E "moe_mma|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Warp Cycles Per Issued|Grid Size|Registers|Eligible|Issued Warp|Waves|dram__|lts__" \
    "$OUT/ncu_moe.txt" | head -60
  # What the warps wait on (a separate run: a metric name this ncu lacks fails only this one).
  PROFILE_MOE_SHAPES=qwen3-30b-a3b timeout 90 ncu --clock-control none --kernel-name regex:moe_mma --metrics \
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_membar_per_issue_active.ratio \
    python benchmarks/profile_moe.py > "$OUT/ncu_moe_stalls.txt" 2>&1 || status=1
  grep -E "moe_mma|stalled|ERR" "$OUT/ncu_moe_stalls.txt" | head -24
  # T = 256 (issue 12's 1.5x row, 1.49x on the H200): 270 us against ~71 us of bytes and ~30 us of
  # mma work at the tensor cores' rate, so neither bound: what do the warps wait on there?
  PROFILE_MOE_SHAPES=qwen3-30b-a3b PROFILE_MOE_T=256 timeout 120 ncu --clock-control none --kernel-name regex:moe_mma \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    --metrics dram__bytes_read.sum python benchmarks/profile_moe.py > "$OUT/ncu_moe256.txt" 2>&1 || status=1
  grep -E "moe_mma|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Warp Cycles Per Issued|Grid Size|Waves|dram__" \
    "$OUT/ncu_moe256.txt" | head -30
  for ev in first normal; do  # the weights' L2 priority (FASTAWQ_MOE_MMA_EVICT), same run
    echo "FASTAWQ_MOE_MMA_EVICT=$ev"
    FASTAWQ_MOE_MMA_EVICT=$ev timeout 60 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 16,256 \
      --backends cuda --no-tune 2>&1 | grep -E "^\| qwen3" || status=1
  done
fi
if [[ " $stages " == *" s24 "* ]]; then
  step s24
  # moe_mma's persistent form (FASTAWQ_MOE_MMA_PERSISTENT=1, off, never run; CUDA_NOTES.md session
  # 24), ~6 min: its tests (every form, a few blocks taking every item, graph replay) gate the rest
  # (a deadlock traps or ends at the timeout); then the op at both MoE shapes in the three forms,
  # same run (cuda: the automatic kernel, the GEMV at 1-4 tokens on Qwen3; cuda:mma: moe_mma at
  # every T, so the one-launch form at one token is measured against the two moe_gemv launches).
  # `s24_e2e` follows with memcheck and the engine.
  if pytest_gate "$OUT/s24_tests.txt" 200 tests/test_moe_mma.py; then
    for pa in 0:0 1:0 1:1; do  # two launches; persistent; persistent, claiming ahead
      echo "FASTAWQ_MOE_MMA_PERSISTENT=${pa%:*} FASTAWQ_MOE_MMA_AHEAD=${pa#*:}"
      FASTAWQ_MOE_MMA_PERSISTENT=${pa%:*} FASTAWQ_MOE_MMA_AHEAD=${pa#*:} timeout 100 python benchmarks/bench_moe.py \
        --shapes qwen3-30b-a3b,mixtral-8x7b --ts 1,16,64,256 --backends cuda,cuda:mma --no-tune 2>&1 \
        | grep -E "^\| (qwen3|mixtral)" || status=1
    done
  else
    status=1
  fi
fi
if [[ " $stages " == *" s24q "* ]]; then
  step s24q
  # `s24` and `s24_e2e`'s deciding rows in one call (~8 min with the build), for a session with
  # one call to spend: the tests but opcheck gate the op in two forms (two launches, persistent) at
  # both shapes (cuda:mma: moe_mma at every T, one token too), then Qwen3 batch 16 in the engine.
  if pytest_gate "$OUT/s24q_tests.txt" 150 tests/test_moe_mma.py -k "not opcheck"; then
    for p in 0 1; do
      echo "FASTAWQ_MOE_MMA_PERSISTENT=$p"
      FASTAWQ_MOE_MMA_PERSISTENT=$p timeout 75 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b \
        --ts 1,16,64,256 --backends cuda,cuda:mma --no-tune 2>&1 | grep -E "^\| (qwen3|mixtral)" || status=1
    done
    # FASTAWQ_SUITE_S24Q_ENGINE=0 leaves the engine row out (a call with ~6 min to spend).
    [ "${FASTAWQ_SUITE_S24Q_ENGINE:-1}" = 0 ] || FASTAWQ_MOE_MMA_PERSISTENT=1 FASTAWQ_TRITON_TUNE=0 timeout 170 \
      python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_MMA_PERSISTENT=0,1 --shape qwen3-30b-a3b --batches 16 \
      --layout packed --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
  else
    status=1
  fi
fi
if [[ " $stages " == *" s24_e2e "* ]]; then
  step s24_e2e
  # After `s24` passed (~6 min): memcheck (the persistent form's cases among them), then Qwen3-30B-A3B
  # at batch 16 / 64 in the engine (the issue's 3,000 tok/s row). The process starts persistent, so
  # the second switch (A/B'd against the start) has it on.
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py 2>&1 | tail -2 \
    || status=1
  FASTAWQ_MOE_MMA_PERSISTENT=1 FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py \
    --compare env:FASTAWQ_MOE_MMA_PERSISTENT=0,1 --compare env:FASTAWQ_MOE_MMA_AHEAD=0,1 --shape qwen3-30b-a3b \
    --batches 16,64 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" s26 "* ]]; then
  step s26
  # The three fp32-sums handoffs (FASTAWQ_QKV_SUMS, FASTAWQ_MOE_O_SUMS, FASTAWQ_DENSE_GU_SUMS; run in
  # session 27, which made all three defaults, RESULTS.md; rerun now, each A/B has the other
  # switches at their defaults, on): their GPU tests in one gate (session 26 fixed the QKV ones:
  # NaN-safe cache compares, head_dim 64 engine models), then Llama-3-8B at batch 1 / 2, gate_up's
  # sums and then the QKV sums A/B'd, ~8 min with a cold build. `s26_moe` has the rest.
  if pytest_gate "$OUT/s26_tests.txt" 240 tests/test_cuda_attention.py tests/test_fused.py tests/test_fused_moe.py \
      tests/test_gemv_packed.py tests/test_moe_op.py -k "fp32 or sums or compiled_route"; then
    FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_DENSE_GU_SUMS=0,1 \
      --compare env:FASTAWQ_QKV_SUMS=0,1 --shape llama-3-8b --batches 1,2 --layout packed --decode 64 --rounds 2 \
      2>&1 | grep -E "^\||on / off" || status=1
  else
    status=1
  fi
fi
if [[ " $stages " == *" s26_moe "* ]]; then
  step s26_moe
  # After `s26`'s gate passed (~7 min): Qwen3-30B-A3B at batch 1 / 2 with the MoE o_proj's sums A/B'd
  # from off, then the QKV sums A/B'd with them on (the process starts with FASTAWQ_MOE_O_SUMS=1:
  # an MoE layer's QKV sums exist only there), then memcheck on the sections the handoffs touch.
  FASTAWQ_MOE_O_SUMS=1 FASTAWQ_TRITON_TUNE=0 timeout 240 python benchmarks/bench_ab.py \
    --compare env:FASTAWQ_MOE_O_SUMS=0,1 --compare env:FASTAWQ_QKV_SUMS=0,1 --shape qwen3-30b-a3b --batches 1,2 \
    --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py \
    --only packed,attention,route 2>&1 | tail -2 || status=1
fi
if [[ " $stages " == *" s27 "* ]]; then
  step s27
  # Session 27's defaults (the three fp32-sums handoffs on; awq_wgmma_packed's 16-token tile at
  # M = 9 .. 16 on sm_90): the engine tests on them and the dispatch's own, then the 16-token tile
  # against awq_gemm_packed in bf16 as well as fp16 (~4 min with a warm build).
  pytest_gate "$OUT/s27_tests.txt" 300 tests/test_fused.py tests/test_fused_moe.py tests/test_cuda_attention.py \
    tests/test_wgmma_packed.py -k "test_fused or 16_token or dispatch" || status=1
  timeout 120 python benchmarks/gemm_table.py --kernels gemm,wgmma --dtypes float16,bfloat16 --ms 9,16 \
    --out "$OUT/s27_wgmma16" 2>&1 | grep -A6 "^| dtype" || status=1
fi
if [[ " $stages " == *" s27b "* ]]; then
  step s27b
  # Session 27's second defaults (the warp-specialized form on the 64- and 128-token tiles, the
  # packed layout and awq_wgmma_packed up to batch 64), ~6 min with a cold build: the op's tests
  # (both forms) and the layout's, memcheck on the GEMM section, then the engine at batch 64 as it
  # now runs (packed; prefill and decode) and A/B'd against the AWQ layout.
  pytest_gate "$OUT/s27b_tests.txt" 200 tests/test_wgmma_packed.py tests/test_packed_layout.py tests/test_fused.py \
    -k "not every_tile_and_split or form_follows" || status=1
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only gemm 2>&1 \
    | tail -2 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_e2e.py --shape llama-3-8b --modes fused-graphs \
    --graph-lengths 64 --batches 64 --max-seq-len 256 --budget 60 --out "$OUT/s27b_b64" 2>&1 | grep -E "^\| fused" \
    | head -1 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_ab.py --compare layout --shape llama-3-8b --batches 48,64 \
    --decode 64 --rounds 1 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" s28 "* ]]; then
  step s28
  # The batch-64 layout question with Triton tuning on (what a user's engine does; ~8 min): session
  # 27 measured the packed layout with awq_wgmma_packed up to M = 64 (its ws form) 1.43x / 1.46x the
  # AWQ layout at batch 48 / 64, but with Triton's heuristic configs in both arms. First the kernels
  # at M = 48 / 64, tuned (which also fills Triton's on-disk cache for the engine's tuning), then
  # the engine A/B (its tuner times every Llama shape at the prefill's and the decode's M on both
  # layouts: minutes). A win moves backend.PACKED_WGMMA_MAX_M to 64.
  timeout 150 python benchmarks/gemm_table.py --layouts awq,packed --kernels wgmma --dtypes float16 --ms 48,64 \
    --out "$OUT/s28_kernels" 2>&1 | grep -A4 "^| dtype" || status=1
  FASTAWQ_PACKED_WGMMA_MAX_M=64 timeout 420 python benchmarks/bench_ab.py --compare layout --shape llama-3-8b \
    --batches 64 --prefill 16 --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
# The grouped op at the Qwen3 / Mixtral rows with FASTAWQ_MOE_MMA_ONE_ROUND=$1 and _EARLY_W2=$2.
moe_id_switches() {
  echo "ONE_ROUND=$1 EARLY_W2=$2"
  FASTAWQ_MOE_MMA_ONE_ROUND=$1 FASTAWQ_MOE_MMA_EARLY_W2=$2 timeout 100 python benchmarks/bench_moe.py \
    --shapes qwen3-30b-a3b,mixtral-8x7b --ts 16,64,256 --backends cuda --no-tune 2>&1 | grep -E "^\| (shape|qwen|mixtral)"
}
if [[ " $stages " == *" s28m "* ]]; then
  step s28m
  # moe_mma's id scans and w2's prologue (sessions 27 / 28, ~4 min): the gather's id loads batched
  # (in every form now: the SASS had them one L2 round trip after another, up to 16 a block from
  # T * k > 1,920); one id a thread read once for the expert scan and the gather at T * k <= 128
  # (FASTAWQ_MOE_MMA_ONE_ROUND=1, off); w2's expert scan, gather and first weight copies before its
  # PDL wait (FASTAWQ_MOE_MMA_EARLY_W2=1, off). Tests, memcheck, the grouped op each way (against
  # session 27's H100 rows: Qwen3 T = 16 / 256 115.7 / 293.6 us; session 26's T = 64 174.0, Mixtral
  # T = 16 / 64 / 256 425.5 / 661.1 / 2,207.7). `s28m_ab`: the engine A/Bs.
  pytest_gate "$OUT/s28m_tests.txt" 240 tests/test_moe_mma.py tests/test_fused_moe.py -k "not persistent" || status=1
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only moe 2>&1 \
    | tail -2 || status=1
  for v in "0 0" "1 0" "0 1"; do
    moe_id_switches $v || status=1
  done
fi
if [[ " $stages " == *" s28m_ab "* ]]; then
  step s28m_ab
  # The engine at batch 8 / 16 (Qwen3-30B-A3B, moe_mma's batches) with each of s28m's switches, ~5 min.
  for sw in FASTAWQ_MOE_MMA_ONE_ROUND FASTAWQ_MOE_MMA_EARLY_W2; do
    FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:$sw=0,1 \
      --shape qwen3-30b-a3b --batches 8,16 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" \
      || status=1
  done
fi
if [[ " $stages " == *" s28d "* ]]; then
  step s28d
  # s28m's two switches made defaults (session 28, ~2 min with targets12 after it): the default form's
  # tests, then the grouped op on the defaults and with both off.
  pytest_gate "$OUT/s28d_tests.txt" 120 tests/test_moe_mma.py -k "default and not persistent" || status=1
  for v in 1 0; do
    moe_id_switches $v $v || status=1
  done
fi
if [[ " $stages " == *" s29 "* ]]; then
  step s29
  # moe_mma on the experts repacked into the packed layout (moe_mma_packed_w4, session 28, not yet
  # run; ~4 min): its tests, memcheck, then the grouped op against moe_mma on the AWQ layout at the
  # batch-16 / 64 / 256 rows (16 and 8 tokens a pass where the backend would pick 16), with four
  # and with two 32-column chunks a warp.
  pytest_gate "$OUT/s29_tests.txt" 150 tests/test_moe_mma.py -k "packed" || status=1
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only moe_packed \
    2>&1 | tail -2 || status=1
  timeout 150 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b --ts 16,64,256 --no-tune \
    --backends cuda:mma,cuda:mmapacked,cuda:mmapacked8 2>&1 | grep -E "^\| (shape|qwen|mixtral)" || status=1
  # Two chunks a warp (warps split over columns and K, a 4-step ring) instead of four.
  FASTAWQ_MOE_PACKED_CHUNKS=2 timeout 100 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b \
    --ts 16,64,256 --no-tune --backends cuda:mmapacked 2>&1 | grep -E "^\| (qwen|mixtral)" || status=1
fi
if [[ " $stages " == *" s29b "* ]]; then
  step s29b
  # The routed experts held in the packed layout (session 29; WQExperts.set_layout, the default
  # for the fused engine on GPUs): moe_gemv_packed_w4's tests (up to 10 failures shown), the
  # engine's MoE tests on it, memcheck, the op against the AWQ layout's at decode sizes and the
  # Triton grouped GEMM at prefill sizes, then the engine A/B (~7 min warm).
  timeout 240 python -m pytest -q -rf --maxfail=10 -p no:cacheprovider tests/test_moe_packed.py tests/test_fused_moe.py \
    tests/test_moe_module.py > "$OUT/s29b_tests.txt" 2>&1; tail -15 "$OUT/s29b_tests.txt"
  grep -qE "[0-9]+ (failed|error)" "$OUT/s29b_tests.txt" && status=1
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py \
    --only moe_gemv_packed 2>&1 | tail -2 || status=1
  timeout 120 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b --ts 1,2,4,8 --no-tune \
    --backends cuda:gemv,cuda:gemvpacked 2>&1 | grep -E "^\| (shape|qwen|mixtral)" || status=1
  timeout 150 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b --ts 256,1024 --no-tune \
    --backends triton,packed:triton 2>&1 | grep -E "^\| (qwen|mixtral)" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare moe_layout --shape qwen3-30b-a3b \
    --batches 1,8,16 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" s31 "* ]]; then
  step s31
  # FASTAWQ_MOE_PACKED_W2_WIDE=1 (session 31; now the host's rule where its grid fills 3/4 of a
  # wave): moe_mma_packed_w4's w2 with a warp a 128-column tile over the whole K range, 4 tiles a
  # block (ncu, H100, Qwen3 T = 16: w2 47 us for 72 MB, 1.58 TB/s, against w13's 2.40; a warp had 6
  # steps between a block's fixed costs).
  # Its tests, the op at T = 16 / 64 / 256 off / on, the engine at batch 16, then ncu of it (~5 min).
  timeout 200 python -m pytest -q -rf --maxfail=10 -p no:cacheprovider tests/test_moe_mma.py \
    -k "packed_kernel_matches and 4w" > "$OUT/s31_tests.txt" 2>&1; tail -4 "$OUT/s31_tests.txt"
  grep -qE "[0-9]+ (failed|error)" "$OUT/s31_tests.txt" && status=1
  for wide in 0 1; do
    echo "FASTAWQ_MOE_PACKED_W2_WIDE=$wide"
    FASTAWQ_MOE_PACKED_W2_WIDE=$wide timeout 90 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b \
      --ts 16,64,256 --no-tune --backends cuda:mmapacked 2>&1 | grep -E "^\| (qwen|mixtral)" || status=1
  done
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_PACKED_W2_WIDE=0,1 \
    --shape qwen3-30b-a3b --batches 16 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
  for wide in 1; do  # (0: moe_ncu with PROFILE_MOE_LAYOUT=packed)
    echo "ncu, FASTAWQ_MOE_PACKED_W2_WIDE=$wide"
    FASTAWQ_MOE_PACKED_W2_WIDE=$wide PROFILE_MOE_LAYOUT=packed PROFILE_MOE_SHAPES=qwen3-30b-a3b timeout 90 ncu \
      --clock-control none --kernel-name regex:moe_mma --section SpeedOfLight --section LaunchStats \
      --metrics dram__bytes_read.sum python benchmarks/profile_moe.py > "$OUT/s31_ncu$wide.txt" 2>&1 || status=1
    grep -E "moe_mma_kernel<|Duration|DRAM Throughput|Grid Size|dram__bytes" "$OUT/s31_ncu$wide.txt" | head -12
  done
fi
if [[ " $stages " == *" s38 "* ]]; then
  step s38
  # The wgmma tiles with a slot's weights in the layout's row order (session 35: thread order scattered
  # each 128-byte line over 8 places, 32 shared wavefronts a warp's copy against 4; H100, same run,
  # geomean x cuBLAS at M = 9 / 16 / 32 1.53 / 1.43 / 1.19 -> 1.82 / 1.63 / 1.27, engine batch 16
  # 1.151x; the default since then, no switch), and FASTAWQ_WGMMA_SCALES=ring (session 35, not yet
  # run: the plain form's (scale, zero) pairs through the ring with each group's first step's weights,
  # where an __ldg a step ahead held 14 % of the stall samples). Their tests and memcheck, the kernel
  # table in both dtypes (the H200's first with row order: session 35's H200 table, thread order, had
  # 1.29 / 1.20 at M = 9 / 16) and with the ring's pairs, the engine A/B, then Nsight Compute's source
  # counters and stall sampling of the 16-token tile at 4096 x 28672 (~5 min).
  timeout 240 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py tests/test_fused.py \
    -k "every_form or six_blocks or sums_form or ring_depths or forced_warpgroup or wgmma_sums or wgmma_decode" \
    2>&1 | tail -2 || status=1
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only packed 2>&1 | tail -2 \
    || status=1
  timeout 150 python benchmarks/gemm_table.py --kernels wgmma --ms 9,16,32,64 --dtypes float16,bfloat16 \
    --out "$OUT/s38_table" 2>&1 | grep -E "geomean|^\| *(float16|bfloat16) *\| *(9|16|32|64) *\|" || status=1
  echo "FASTAWQ_WGMMA_SCALES=ring"
  FASTAWQ_WGMMA_SCALES=ring timeout 100 python benchmarks/gemm_table.py --kernels wgmma --ms 9,16,32 --dtypes float16 \
    --out "$OUT/s38_ring" 2>&1 | grep -E "geomean|^\| *float16 *\| *(9|16|32) *\|" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_SCALES=0,ring \
    --shape llama-3-8b --batches 9,16,32 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "on / off" || status=1
  ncu_source s38_wg16 python benchmarks/profile_gemm_packed.py --kernel wgmma --ms 16 --shapes 4096x28672
fi
if [[ " $stages " == *" s38m "* ]]; then
  step s38m
  # Issue 12's grouped-GEMM row (Qwen3 T = 256: 1.46x on the H200, target 1.5x) and the MoE kernels'
  # L2 priority: FASTAWQ_MOE_MMA_EVICT=auto (session 35, not yet run: normal where an expert reached
  # expects 8 or more assignments, first below; H100 session 26: T = 256 3 % faster at normal, T = 16
  # 2 % slower). Its test, then bench_moe on both layouts' kernels per setting (~2 min).
  timeout 120 python -m pytest -x -q -p no:cacheprovider tests/test_moe_mma.py -k "l2_priority" 2>&1 | tail -2 \
    || status=1
  for ev in first normal; do
    echo "FASTAWQ_MOE_MMA_EVICT=$ev"
    FASTAWQ_MOE_MMA_EVICT=$ev timeout 100 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b \
      --ts 16,64,256 --backends cuda,cuda:mmapacked --no-tune 2>&1 | grep -E "^\| (qwen3|mixtral)" || status=1
  done
fi
if [[ " $stages " == *" s38b "* ]]; then
  step s38b
  # Batch 64 on the packed layout again, now that the wgmma tiles keep their weights in row order
  # (session 28, H100, tuned: AWQ layout 10,235.5 against packed with awq_wgmma_packed up to M = 64
  # 10,147.8, 0.991x, so the engine keeps the AWQ layout above batch 32). After `targets11`, whose
  # batch-64 row leaves Triton's tuning cache warm (~1.5 min).
  FASTAWQ_PACKED_WGMMA_MAX_M=64 timeout 300 python benchmarks/bench_ab.py --compare layout --shape llama-3-8b \
    --batches 64 --prefill 16 --decode 64 --rounds 2 2>&1 | grep -E "^\||on / off" || status=1
fi
if [[ " $stages " == *" s39 "* ]]; then
  step s39
  # Session 36's defaults on a GPU: awq_gemm_packed's weights in row order in every x mode, the
  # 16-token wgmma tile's pairs through the ring (and FASTAWQ_WGMMA_SCALES forced both ways), the MoE
  # GEMMs' L2 priority by layout; their memcheck; then the kernel table's automatic choice on the
  # packed layout at M = 1 .. 64 in both dtypes (issue 11's rows; ~4 min).
  timeout 240 python -m pytest -x -q -p no:cacheprovider tests/test_gemm_packed.py tests/test_wgmma_packed.py \
    tests/test_moe_mma.py -k "x_modes or every_form or l2_priority" 2>&1 | tail -2 || status=1
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only packed 2>&1 | tail -2 \
    || status=1
  timeout 200 python benchmarks/gemm_table.py --layouts packed --ms 1,2,4,8,16,32,64 --dtypes float16,bfloat16 \
    --out "$OUT/s39_table" 2>&1 | grep -E "geomean|^\| *(float16|bfloat16) *\| *[0-9]+ *\|" || status=1
fi
if [[ " $stages " == *" s40 "* ]]; then
  step s40
  # FASTAWQ_WGMMA_GU_SUMS=1 (session 36, not yet run): at the wgmma's rows gate_up adds into fp32 sums
  # that act_mul_sums rounds, so the step's largest projection ends without its split-K tail (its
  # barrier, fence and conversion held ~20 % of the 16-token tile's stall samples). Its decode tests,
  # then the engine A/B at batch 9 / 16 / 32 / 64, and the sums form itself at batch 64 (made the
  # default at 9-32 in session 35; at 64 it keeps the plain form where the plain op takes the ws one).
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_fused.py tests/test_layer_ops.py \
    -k "wgmma_sums_decode or act_mul_sums" 2>&1 | tail -2 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_GU_SUMS=0,1 \
    --shape llama-3-8b --batches 9,16,32,64 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_SUMS=0,1 \
    --shape llama-3-8b --batches 64 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s41 "* ]]; then
  step s41
  # The 64-token tile on the 4096-wide layers (session 36, H100: 0.71 / 0.73x cuBLAS at 4096 x 6144 /
  # 4096 x 4096 against 1.29 / 1.14 on the two large ones). The ws form takes 256 columns a block and
  # one block an SM, so N = 4096 gives 16 column tiles and ~8 K splits of ~16 steps, about as many as
  # its ring's lead of 9: a guess that prologue and split-K tail dominate. The existing switches, one
  # call: the ws ring at 8 slots, the plain form on two warpgroups, the plain form on one (~2 min).
  for env in "" FASTAWQ_WGMMA_WS_DEPTH=8 FASTAWQ_WGMMA_FORM=plain \
      "FASTAWQ_WGMMA_FORM=plain FASTAWQ_WGMMA_WARPGROUPS=1"; do
    echo "setting: ${env:-default}"
    env $env timeout 100 python benchmarks/gemm_table.py --kernels wgmma --ms 48,64 --dtypes float16 \
      --out "$OUT/s41" 2>&1 | grep -E "^\| *float16 *\| *4096 *\||geomean|^\| *float16 *\| *(48|64) *\|" || status=1
  done
fi
if [[ " $stages " == *" s42 "* ]]; then
  step s42
  # Session 38: awq_wgmma_packed_sums in the warp-specialized form too (FASTAWQ_WGMMA_FORM=ws), the ws
  # ring at 8 slots by default, gate_up's sums on by default. The tests of both, memcheck over the
  # packed kernels, then the engine with the sums launches in the plain form against the ws form
  # (measured: 0.882x / 0.918x at batch 48 / 64, so sums keep the plain one), and the op's table.
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py tests/test_fused.py \
    -k "warp_specialized or sums or form_follows or ring_depths or wgmma_sums_decode" 2>&1 | tail -2 || status=1
  timeout 150 compute-sanitizer --tool memcheck python benchmarks/sanitize.py --only packed 2>&1 | tail -3 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 160 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_FORM=plain,ws \
    --shape llama-3-8b --batches 48,64 --layout packed --decode 64 --rounds 2 2>&1 | grep -E "on / off" || status=1
  timeout 60 python benchmarks/gemm_table.py --kernels wgmma --ms 48,64 --dtypes float16,bfloat16 --out "$OUT/s42" \
    2>&1 | grep -E "geomean|^\| *(float16|bfloat16) *\| *(48|64) *\|" || status=1
fi
if [[ " $stages " == *" s43 "* ]]; then
  step s43
  # FASTAWQ_WGMMA_MIN_STEPS (session 38, not yet run): the one-wave plan cuts the 4096-wide layers at
  # 16 tokens into K ranges of 6-8 steps, each adding its fp32 tile into the sums (4096 x 4096: 768
  # blocks, ~6 MB of reductions for 8 MB of weights). Its tests, the op's table at M = 16 / 32 / 64 with
  # floors of 4 (the default), 8 and 16, then the engine A/B at batch 16 / 32 (~3.5 min).
  timeout 100 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py -k min_steps 2>&1 | tail -1 || status=1
  table_by_env FASTAWQ_WGMMA_MIN_STEPS "4 8 16" s43 \
    "geomean|^\| *float16 *\| *4096 *\| *4096 *\||^\| *float16 *\| *(16|32|64) *\|" \
    --kernels wgmma --ms 16,32,64 --dtypes float16 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 120 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_MIN_STEPS=4,8 \
    --compare env:FASTAWQ_WGMMA_MIN_STEPS=4,16 --shape llama-3-8b --batches 16,32 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s45 "* ]]; then
  step s45
  # Where the 16-token tile waits at 4096 wide on this tree (session 38; ~1.5 min): Nsight Compute's
  # source counters and stall reasons, the pipes' utilization and the memory tables at 4096 x 4096,
  # ranked by benchmarks/ncu_stalls.py (session 36 sampled 4096 x 28672 before the ring pairs).
  ncu_source s45_wg16 python benchmarks/profile_gemm_packed.py --kernel wgmma --ms 16 --shapes 4096x4096
fi
if [[ " $stages " == *" s48 "* ]]; then
  step s48
  # Session 39: the cluster reduction the default (FASTAWQ_WGMMA_CLUSTER=0 turns it off) for plans of
  # <= 12 splits. Its tests and memcheck over the packed kernels, the op's table at M = 9 / 16 / 32 in
  # both dtypes, then fp16 with the bound at 16 and 24 splits (FASTAWQ_WGMMA_CLUSTER_PLAN; ~3 min).
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py -k "cluster" 2>&1 | tail -1 \
    || status=1
  memcheck_packed || status=1
  timeout 100 python benchmarks/gemm_table.py --kernels wgmma --ms 9,16,32 --dtypes float16,bfloat16 \
    --out "$OUT/s48" 2>&1 | grep -E "geomean|^\| *(float16|bfloat16) *\| *(9|16|32) *\|" || status=1
  table_by_env FASTAWQ_WGMMA_CLUSTER_PLAN "16 24" s48 "geomean|^\| *float16 *\|" --kernels wgmma --ms 9,16,32 \
    --dtypes float16 || status=1
  # The plain op's projections now end in a cluster, not the workspace: the engine's sums forms
  # (gate_up's, then every projection's) against it, on / off (~2 min).
  FASTAWQ_TRITON_TUNE=0 timeout 180 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_GU_SUMS=1,0 \
    --compare env:FASTAWQ_WGMMA_SUMS=1,0 --shape llama-3-8b --batches 16,32 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s49 "* ]]; then
  step s49
  # Session 39: gate_up's wgmma sums off at 17-32 rows by default (the plain op's 2 splits meet in a
  # cluster; batch 32 1.034x in s48). The decode tests with the new default, then gate_up's sums
  # forced on / off and QKV's sums on / off at batch 20 / 32 (~2.5 min).
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_fused.py \
    -k "wgmma_sums_decode or wgmma_sums_switch" 2>&1 | tail -1 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_GU_SUMS=1,0 \
    --compare env:FASTAWQ_QKV_SUMS=1,0 --shape llama-3-8b --batches 20,32 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s51 "* ]]; then
  step s51
  # Session 39: the 64-token tile in the plain form with its K splits in a cluster (the default now;
  # ws keeps the 128-token tile). The wgmma tests of the forms and the cluster, the engine's wgmma
  # decode tests, issue 11's kernel table (the automatic choice on the packed layout at M = 1 .. 64,
  # both dtypes), then memcheck over the packed kernels (~5 min).
  timeout 240 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py tests/test_fused.py \
    -k "cluster or form_follows or warp_specialized or every_form or wgmma_sums_decode" 2>&1 | tail -1 || status=1
  timeout 200 python benchmarks/gemm_table.py --layouts packed --ms 1,2,4,8,16,32,48,64 --dtypes float16,bfloat16 \
    --out "$OUT/s51_table" 2>&1 | grep -E "geomean|^\| *(float16|bfloat16) *\| *[0-9]+ *\| *[0-9.]+x" || status=1
  memcheck_packed || status=1
fi
if [[ " $stages " == *" s53 "* ]]; then
  step s53
  # Session 40: the 64-token plan takes one warpgroup where two would cut K into more short ranges
  # than the cluster serves (FASTAWQ_WGMMA_ONE_WG, on unless "0"). Its tests and the 64-token tile's,
  # then issue 11's kernel table at M = 40 .. 64 (the automatic choice, both dtypes) with the rule off
  # and on (~3 min).
  timeout 240 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py \
    -k "one_warpgroup or form_follows or cluster_reduction_of_the_64 or every_form" 2>&1 | tail -1 || status=1
  table_by_env FASTAWQ_WGMMA_ONE_WG "0 1" s53_table "geomean|^\| *(float16|bfloat16) *\| *[0-9]+ *\| *[0-9.]+x" \
    --layouts packed --ms 40,48,56,64 --dtypes float16,bfloat16 || status=1
fi
if [[ " $stages " == *" s56 "* ]]; then
  step s56
  # Session 41's add + RMSNorm forms (FASTAWQ_NORM_FORM: 1 loads the norm weight before the PDL wait,
  # 2, the default since a1d451b, also zeroes later projections' sums from a second grid dimension):
  # their tests, the launch alone at the engine's shapes, then the engine's decode at batch 1 / 16 / 64
  # against form 0 (~2 min).
  timeout 120 python -m pytest -x -q -p no:cacheprovider tests/test_layer_ops.py -k "add_rms_norm" 2>&1 \
    | tail -1 || status=1
  timeout 90 python benchmarks/bench_norm.py 2>&1 | tail -12 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 300 python benchmarks/bench_ab.py --compare env:FASTAWQ_NORM_FORM=0,1 \
    --compare env:FASTAWQ_NORM_FORM=0,2 --shape llama-3-8b --batches 1,16,64 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s61 "* ]]; then
  step s61
  # Issue 12's grouped MoE at T = 256 (1.48x bmm on the H200, 1.5x needed) on the experts' layouts: the
  # AWQ layout's moe_mma (the row so far), the packed experts the engine takes on sm_90
  # (backend.experts_layout), and the packed kernel's forms: 2 chunks a warp, w2's wide form forced
  # off / on (~1.5 min); then the same forms in the engine's Qwen3 batch-16 decode.
  timeout 60 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 256 --backends cuda,cuda:mmapacked \
    --no-tune 2>&1 | tail -4 || status=1
  for v in "FASTAWQ_MOE_PACKED_CHUNKS=2" "FASTAWQ_MOE_PACKED_W2_WIDE=0" "FASTAWQ_MOE_PACKED_W2_WIDE=1"; do
    echo "$v"
    env "$v" timeout 60 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 256 --backends cuda:mmapacked \
      --no-tune 2>&1 | tail -2 || status=1
  done
  # Issue 12's Qwen3 batch-16 row (2,754 against 3,000): the packed kernel's forms in the engine, each
  # against the rule (w2's wide form forced on: -2.3 % on an H100 in session 31, before the later
  # defaults; 2 chunks a warp) (~2 min).
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_PACKED_W2_WIDE=rule,1 \
    --compare env:FASTAWQ_MOE_PACKED_CHUNKS=4,2 --shape qwen3-30b-a3b --batches 16 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s34p "* ]]; then
  step s34p
  # The prefill row on the new default chunk (4096 tokens a row: a 2,048-token prompt in one pass;
  # session 33 H100: 36,142 tok/s one pass, 30,920 in chunks of 1024, fp16 33,697): fp16 then the
  # engine as a user gets it (~1.5 min).
  pre="--shape llama-3-8b --graph-lengths 2048 --other-len 2048 --batches 1 --max-seq-len 4096 --budget 1"
  timeout 120 python benchmarks/bench_e2e.py $pre --modes fp16 --out "$OUT/s34p_fp16" 2>&1 | grep -E "^\| fp16" \
    | head -1 || status=1
  timeout 120 python benchmarks/bench_e2e.py $pre --modes fused-graphs --out "$OUT/s34p" 2>&1 | grep -E "^\| fused" \
    | head -1 || status=1
fi
if [[ " $stages " == *" s33 "* ]]; then
  step s33
  # Issue 11 asks for the engine's decode rows in fp16 and bf16; bf16 has not been measured since the
  # packed layout and the sums handoffs (~4 min): the Llama-3-8B shape at batch 1 and 16, then
  # Qwen3-30B-A3B at batch 1 and 16, each dtype in turn, fastawq bench as a user runs it.
  for shape in llama-3-8b qwen3-30b-a3b; do
    for dt in float16 bfloat16; do
      echo "$shape $dt"
      FASTAWQ_TRITON_TUNE=0 timeout 150 python -m fastawq bench --shape $shape --dtype $dt --batch-size 1,16 \
        --lengths 64 --max-seq-len 256 2>&1 | grep -E "^\| fused" | head -4 || status=1
    done
  done
fi
if [[ " $stages " == *" s28p "* ]]; then
  step s28p
  # Where a batch-16 decode step goes on the session-27 defaults (~2 min; issue 11's and 12's
  # batch-16 rows: 4,041 / 2,470 against 6,000 / 3,000 on the H200): each kernel's microseconds a
  # step, Qwen3-30B-A3B then the Llama-3-8B shape, packed layout.
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/profile_step.py qwen3-30b-a3b:16 llama-3-8b:16 2>&1 \
    | grep -E "^#####|us/step|share of the step" | head -80 || status=1
fi
if [[ " $stages " == *" s58 "* ]]; then
  step s58
  # Where the Llama-3-8B shape's batch-1 and batch-64 decode steps go on session 41's defaults (~2 min;
  # H200 521.3 / 14,820.8 tok/s against 600 / 16,000; batch 64 has not been profiled since the wgmma
  # sums tiles and the norm's spread zeroing): each kernel's share of a step, packed layout.
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/profile_step.py llama-3-8b:1 llama-3-8b:64 2>&1 \
    | grep -E "^#####|us/step|share of the step" | head -80 || status=1
fi
if [[ " $stages " == *" s59 "* ]]; then
  step s59
  # Qwen3-30B-A3B's attention projections at batch 9-32 (QKV 2048 x 5120, o_proj 4096 x 2048: 0.88 ms of
  # the H100's 6.30 ms batch-16 step for ~9.4 MB a layer, i.e. fixed costs): the automatic choice on the
  # packed layout against each compiled kernel forced, fp16 (~1 min). If awq_mma_packed (no TMA ring,
  # no cluster) leads the wgmma tiles on these small shapes, the choice should weigh the layer's bytes.
  timeout 150 python benchmarks/gemm_table.py --layouts packed --kernels mma,wgmma,gemm \
    --shapes 2048x5120,4096x2048 --ms 9,12,16,24,32 --dtypes float16 --out "$OUT/s59_table" 2>&1 | tail -30 || status=1
fi
if [[ " $stages " == *" s62 "* ]]; then
  step s62
  # Qwen3-30B-A3B's attention projections keep a fixed cost (s59, H100: QKV 2048 x 5120 at M = 16 10.3 us
  # for 5.5 MB, the automatic wgmma tile; no other kernel leads). At 16 tokens the one-wave plan cuts K into
  # ranges of 4 steps (QKV 40 tiles x 16 splits): as many fp32 adds into the sums as weight bytes. The
  # split floor FASTAWQ_WGMMA_MIN_STEPS at 4 / 8 / 16 in the op's table on those shapes, then in the Qwen3
  # batch-16 engine (sums form), then where that step goes on the defaults (~4 min).
  table_by_env FASTAWQ_WGMMA_MIN_STEPS "4 8 16" s62 "geomean|^\| *float16 *\|" --kernels wgmma \
    --shapes 2048x5120,4096x2048 --ms 9,16,32 --dtypes float16 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 200 python benchmarks/bench_ab.py --compare env:FASTAWQ_WGMMA_MIN_STEPS=4,8 \
    --compare env:FASTAWQ_WGMMA_MIN_STEPS=4,16 --shape qwen3-30b-a3b --batches 16 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 150 python benchmarks/profile_step.py qwen3-30b-a3b:16 2>&1 \
    | grep -E "^#####|us/step|share of the step" | head -40 || status=1
fi
if [[ " $stages " == *" s63 "* ]]; then
  step s63
  # The split floor in the op (s62, H100: at 8 steps Qwen3's attention projections went 1.09 -> 1.42x
  # cuBLAS at M = 16: QKV's 16 splits of 4 steps meet in a cluster as 8 of 8, o_proj's 32 through the
  # workspace become 16; 8 is now the op's default at 16 and 32 tokens), and moe_mma's 24-token passes
  # (FASTAWQ_MOE_MMA_PASS=24: three n-tiles, 168 registers with 64-136 bytes of spills at 3 blocks an
  # SM): their tests, then the grouped MoE at Qwen3's T = 256 in passes of 24 / 16 / 8 tokens under
  # random and balanced routing (an expert takes 1.02 / 1.43 / 2.43 passes under random routing, 1 / 1 /
  # 2 balanced: how much of the time the passes are), then the op's table on the Llama-3-8B and Qwen3
  # attention shapes, M = 9 / 16 / 32 fp16, the default ("default": not a count) against 4 (~3.5 min).
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py tests/test_moe_mma.py \
    -k "floor or 24" 2>&1 | tail -1 || status=1
  for r in random balanced; do
    timeout 90 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 256 \
      --backends cuda:mma24,cuda:mma16,cuda:mma8 --no-tune --routing $r 2>&1 | tail -3 || status=1
  done
  # Where else a pass of 24 may pay (random routing): Qwen3 at T = 512 (32 a expert), Mixtral at
  # T = 64 / 256 / 1024 (16 / 64 / 256 an expert).
  timeout 90 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 512 \
    --backends cuda:mma24,cuda:mma16 --no-tune 2>&1 | tail -2 || status=1
  timeout 120 python benchmarks/bench_moe.py --shapes mixtral-8x7b --ts 64,256,1024 \
    --backends cuda:mma24,cuda:mma16 --no-tune 2>&1 | tail -4 || status=1
  table_by_env FASTAWQ_WGMMA_MIN_STEPS "default 4" s63 "geomean|^\| *float16 *\|" --kernels wgmma \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096,2048x5120,4096x2048 --ms 9,16,32 --dtypes float16 \
    || status=1
fi
if [[ " $stages " == *" s64 "* ]]; then
  step s64
  # moe_mma_packed_w4's L2 prefetch of the steps past its 2-step register ring (FASTAWQ_MOE_PACKED_PREFETCH,
  # off by default): Qwen3-30B-A3B's w2 at batch 16 streams ~1.8 TB/s on the H100 against w13's ~2.3
  # (session 43), a warp holding 6 steps of K with 2 in flight at a time. Its tests and memcheck, the
  # grouped op at T = 16 / 64 on both MoE shapes for N = 0 / 2 / 4 / 8, then the Qwen3 engine at batch
  # 8 / 16, N = 4 and 8 against 0 (~5 min).
  timeout 200 python -m pytest -x -q -p no:cacheprovider tests/test_moe_mma.py -k "prefetch" 2>&1 | tail -1 \
    || status=1
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only moe_packed \
    2>&1 | tail -2 || status=1
  for pf in 0 2 4 8; do
    echo "FASTAWQ_MOE_PACKED_PREFETCH=$pf"
    FASTAWQ_MOE_PACKED_PREFETCH=$pf timeout 120 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b \
      --ts 16,64 --backends cuda:mmapacked --no-tune 2>&1 | tail -5 || status=1
  done
  FASTAWQ_TRITON_TUNE=0 timeout 240 python benchmarks/bench_ab.py --compare env:FASTAWQ_MOE_PACKED_PREFETCH=0,4 \
    --compare env:FASTAWQ_MOE_PACKED_PREFETCH=0,8 --shape qwen3-30b-a3b --batches 8,16 --layout packed --decode 64 \
    --rounds 2 2>&1 | grep -E "on / off" || status=1
fi
if [[ " $stages " == *" s23 "* ]]; then
  step s23
  # awq_wgmma_packed's forms, ~6 min: the ws form's tests and kernel table (with the 16-token tile
  # of both forms against awq_gemm_packed, the automatic choice at M = 9..16), then the engine A/Bs.
  # (Session 22's two unrun handoffs and the memcheck, which covers the ws form: `unrun22`.)
  # Each form's forced tiles first (96 cases each, the 16-token tile among them; the ws form's at
  # both ring depths): a hang (an mbarrier protocol error) ends at the timeout, and a form that
  # fails stays out of the kernel table.
  kernels=gemm
  timeout 150 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py -k "every_tile and not warp" \
    2>&1 | tail -2 && kernels=$kernels,wgmmaplain || status=1
  FASTAWQ_WGMMA_FORM=ws timeout 150 python -m pytest -x -q -p no:cacheprovider tests/test_wgmma_packed.py \
    -k "warp_specialized_every" 2>&1 | tail -4 && kernels=$kernels,wgmmaws || status=1
  timeout 150 python benchmarks/gemm_table.py --kernels $kernels --dtypes float16 \
    --ms 16,32,64,256,4096 --out "$OUT/wgmma_ws" 2>&1 | grep -A10 "^| dtype" || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_ab.py --compare wgmma16 \
    --compare env:FASTAWQ_WGMMA_FORM=0,ws --shape llama-3-8b --batches 16,32 --layout packed --decode 64 --rounds 1 \
    2>&1 | grep -E "^\||on / off" || status=1
fi
# `targets` = `targets12` (the MoE rows, ~4 min; first, where an H200 call may be short) then
# `targets11` (the Llama rows and the memory profile, ~6 min).
if [[ " $stages " == *" targets "* || " $stages " == *" targets12 "* ]]; then
  step targets12
  # Issue 12's rows on this tree (RESULTS.md "Where the targets stand"): Qwen3-30B-A3B decode at
  # batch 1 / 16, Mixtral-8x7B at batch 1, the grouped MoE op at T = 1 / 16 / 256. Packed layout,
  # heuristic Triton configs, all layers built; one engine per batch size, as from_quantized's
  # batch_size builds it (the experts' layout depends on it: backend.experts_layout).
  for b in 1 16; do
    FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_e2e.py --shape qwen3-30b-a3b --layout packed \
      --modes fused-graphs --graph-lengths 64 --batches $b --max-seq-len 256 --budget 70 --out "$OUT/t_qwen3_b$b" \
      2>&1 | grep -E "^\| fused" | head -3 || status=1
  done
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_e2e.py --shape mixtral-8x7b --layout packed \
    --modes fused-graphs --graph-lengths 64 --batches 1 --max-seq-len 256 --budget 60 --out "$OUT/t_mixtral" \
    2>&1 | grep -E "^\| fused" | head -3 || status=1
  timeout 60 python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --ts 1,16,256 --backends cuda --no-tune 2>&1 \
    | tail -5 || status=1
fi
if [[ " $stages " == *" targets "* || " $stages " == *" targets11 "* ]]; then
  step targets11
  # Issue 11's engine rows: Llama-3-8B shape decode at batch 1 with the memory row (max_seq_len
  # 4096) and at batch 16 / 64; each in the layout the engine picks (bench_e2e.py's --layout auto,
  # its default since session 27: packed up to batch 64 on sm_90 GPUs since session 36).
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_e2e.py --shape llama-3-8b --layout packed \
    --modes fused-graphs --graph-lengths 64 --batches 1 --max-seq-len 4096 --budget 60 --out "$OUT/t_llama_b1" \
    2>&1 | grep -E "^\| (Mode|fused)" | head -4 || status=1
  FASTAWQ_TRITON_TUNE=0 timeout 100 python benchmarks/bench_e2e.py --shape llama-3-8b --layout packed \
    --modes fused-graphs --graph-lengths 64 --batches 16 --max-seq-len 256 --budget 60 --out "$OUT/t_llama_b16" \
    2>&1 | grep -E "^\| fused" | head -3 || status=1
  # Batch 64: the packed layout's awq_wgmma_packed since session 36 (H100: 1.258x the AWQ layout's
  # tuned Triton GEMM); --layout auto as a user gets it, Triton tuning on (the prefill's GEMMs).
  timeout 300 python benchmarks/bench_e2e.py --shape llama-3-8b --layout auto \
    --modes fused-graphs --graph-lengths 64 --batches 64 --max-seq-len 256 --budget 60 --out "$OUT/t_llama_b64" \
    2>&1 | grep -E "^\| fused" | head -3 || status=1
  # The memory row's 0.02 GiB over: what is live at the measured peak (~1 min).
  FASTAWQ_TRITON_TUNE=0 timeout 90 python benchmarks/profile_memory.py --shape llama-3-8b --prompt 64 --layout packed \
    --out "$OUT/memory.json" 2>&1 | tail -25 || status=1
fi
if [[ " $stages " == *" e2e "* ]] && [ -f benchmarks/bench_e2e.py ]; then
  step e2e
  python benchmarks/bench_e2e.py --out "$OUT" 2>&1 | tee "$OUT/e2e.log" || status=1
fi
if [[ " $stages " == *" quantize "* ]] && [ -f benchmarks/bench_quantize.py ]; then
  step quantize
  python benchmarks/bench_quantize.py --shape llama-3-8b --json "$OUT/bench_quantize.json" 2>&1 | tee "$OUT/quantize.log" || status=1
fi
step done
exit $status
