#!/usr/bin/env bash
# Everything the GPU machine runs in one lease: build, CUDA tests, benchmarks, UCI rows, scaling, 2-GPU K@V.
# Usage (from the repo root, data copied to .data/uci): bash experiments/run_h200.sh OUTDIR
# Each stage has its own time limit so that one slow stage cannot take the others' results with it.
set -u
OUT=${1:-/tmp/gpfast-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GPFAST_BUILD_DIR=/tmp/gpb MAX_JOBS=16 NCCL_NVLS_ENABLE=0
log() { echo "== $* ($(date +%T))"; }
log build; timeout 90 python -m gpfast.build > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
log tests; timeout 80 python -m pytest tests -q -m cuda -p no:cacheprovider > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"
log bench_ops; timeout 90 python experiments/bench_ops.py --reps 5 > "$OUT/bench_ops.log" 2>&1; tail -12 "$OUT/bench_ops.log"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  log distributed
  rm -f experiments/results/bench_distributed.json
  timeout 40 torchrun --nproc-per-node=1 --master-port=29601 experiments/bench_distributed.py --sizes 2000000 --reps 1 > "$OUT/dist1.log" 2>&1; tail -2 "$OUT/dist1.log"
  timeout 30 torchrun --nproc-per-node=2 --master-port=29602 experiments/bench_distributed.py --sizes 2000000 --reps 1 > "$OUT/dist2.log" 2>&1; tail -2 "$OUT/dist2.log"
  timeout 30 torchrun --nproc-per-node=2 --master-port=29603 -m gpfast fit --dataset yacht --iters 5 --solver cg --distributed --quiet > "$OUT/distfit.log" 2>&1; tail -4 "$OUT/distfit.log"
fi
log bench_matmul; timeout 40 python experiments/bench_matmul.py --sizes 40000 200000 1000000 --reps 3 > "$OUT/bench_matmul.log" 2>&1; tail -6 "$OUT/bench_matmul.log"
log uci; timeout 150 python experiments/uci_table.py --data-dir .data/uci --device cuda --splits 0 --iters 50 --quiet --datasets pol kin40k > "$OUT/uci.log" 2>&1; tail -12 "$OUT/uci.log"
log scaling; timeout 40 python experiments/scaling.py --sizes 10000 40000 100000 --gpytorch-max 40000 > "$OUT/scaling.log" 2>&1; tail -8 "$OUT/scaling.log"
log done
tar czf "$OUT/results.tgz" experiments/results
