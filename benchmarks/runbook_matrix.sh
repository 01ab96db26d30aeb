#!/usr/bin/env bash
# The runbook's test matrix (/work/shared/runbook.md, "Recommended Test Matrix"), for the record on a GPU machine:
#   benchmarks/runbook_matrix.sh NPROC [BACKEND]      e.g.  1 auto   |   4 gloo
# Runs: native fp32; registry bf16 fp32-ref; matching drift; triton; sm90; larger stress. Does not stop at the
# first failure (each command's status is printed), so one run records the whole matrix.
set -u
NPROC=${1:-1}
BACKEND=${2:-auto}
run() {
  echo "=== [nproc=$NPROC backend=$BACKEND] $*"
  timeout 300 torchrun --standalone --nproc_per_node="$NPROC" tests/linear_logp_tp.py --backend "$BACKEND" "$@"
  echo "=== exit status $?"
}
run --op-source native --dtype fp32 --tokens 128 --hidden-size 256 --vocab-size 4096 --uneven-shards
run --op-source registry --dtype bf16 --reference-mode fp32 --tokens 256 --hidden-size 512 --vocab-size 8192 --uneven-shards
run --op-source registry --dtype bf16 --reference-mode matching --tokens 128 --hidden-size 512 --vocab-size 8192 --atol 0.75 --rtol 0.75
run --op-source triton --dtype bf16 --reference-mode fp32 --tokens 256 --hidden-size 512 --vocab-size 8192
run --op-source sm90 --dtype bf16 --reference-mode fp32 --tokens 256 --hidden-size 512 --vocab-size 8192
run --op-source registry --dtype bf16 --reference-mode fp32 --tokens 256 --hidden-size 512 --vocab-size 8192 --run-stress --stress-tokens 4096 --stress-hidden-size 2048 --stress-vocab-size 32768
