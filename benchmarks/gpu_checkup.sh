#!/usr/bin/env bash
# One GPU call that checks and measures the fused sources, for a short device lease (about 8 minutes on an H200):
#   bash benchmarks/gpu_checkup.sh [OUT_DIR]          (OUT_DIR defaults to $OUT, then results/checkup)
# 1. pytest tests/gpu -m "gpu or stress"           -> tests.log
# 2. the runbook matrix on this GPU (TP=1)          -> runbook.log
# 3. bench_linear_logp.py, eager / sm90 / triton    -> bench.json, bench.png, bench.log
# 4. latency.py and launch_cost.py (host timelines) -> host.log
# 5. kernel_breakdown.py at the three issue shapes  -> breakdown.log
# Steps run in order and do not stop at a failure; each one's exit status is printed, and the script exits non-zero
# when any step failed. Multi-GPU runs: see
# benchmarks/bench_tp_scaling.py and benchmarks/runbook_matrix.sh NPROC.
set -u
OUT_DIR=${1:-${OUT:-results/checkup}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FAILED=""
step() {
  local name=$1 limit=$2 rc; shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit status $rc"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
}
date -u
git log --oneline -1 2>/dev/null || true
step tests 300 python3 -m pytest tests/gpu -m "gpu or stress" -q -p no:cacheprovider
tail -2 "$OUT_DIR/tests.log"
step runbook 120 bash benchmarks/runbook_matrix.sh 1 auto
grep -c "exit status 0" "$OUT_DIR/runbook.log"
step bench 300 python3 benchmarks/bench_linear_logp.py --sources torch_eager,sm90,triton \
  --out "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png"
grep -v "^#" "$OUT_DIR/bench.log"
step host 120 bash -c "python3 benchmarks/latency.py --rounds 7 --calls 100 && python3 benchmarks/launch_cost.py"
grep -E "timeline|fwd|GEMM|thread" "$OUT_DIR/host.log"
step breakdown 150 python3 benchmarks/kernel_breakdown.py --shapes 4096x2048x131072,4096x2048x8192,8192x4096x128256
grep "^##" "$OUT_DIR/breakdown.log"
echo "=== failed steps:${FAILED:- none}"
[ -z "$FAILED" ]
