#!/usr/bin/env bash
# The GPU machine's work in named stages, so that one lease runs several of them (some side by side on two GPUs).
# Usage (repo root, UCI data copied to .data/uci): bash experiments/run_h200.sh OUTDIR STAGE [STAGE ...]
# Stages: build, tests, tests_dist, sanitize, bench_ops, bench_matmul, bench_matmul_rhs, scaling1m, dist1, dist2, distfit,
#         uci:SET[,SET...][:ROW[,ROW]]  (ROW: gpytorch, gpytorch+gpfast, gpfast; stem uci_<sets>_<a|b|c letters>),
#         gpfast's training engine (issue 12; results and logs in OUTDIR): tests_engine, engine_uci_a, engine_uci_b,
#         engine_uci_c (rows b and c on pol/elevators/bike/kin40k, protein/keggdirected, keggundirected), stored_product,
#         engine1m
# Single-GPU stages run on GPU $GPU (default 0), so two chains can run side by side on a two-GPU machine.
# Set GPFAST_COMMIT to the commit being measured (the GPU machine's copy of the tree has no .git), e.g. from
# `git describe --always --dirty` on the host; results otherwise say "unknown".
# Each stage has its own time limit so that one slow stage cannot take the others' results with it.
set -u
[ $# -ge 2 ] || { echo "usage: $0 OUTDIR STAGE [STAGE ...]" >&2; exit 2; }
OUT=$1; shift
[ -n "${GPFAST_COMMIT:-}" ] || echo "warning: GPFAST_COMMIT is not set; results will name no commit" >&2
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GPFAST_BUILD_DIR=/tmp/gpb MAX_JOBS=16 NCCL_NVLS_ENABLE=0
G=${GPU:-0}
log() { echo "== $* ($(date +%T))"; }
for st in "$@"; do
  log "$st"
  case "$st" in
    build) timeout 120 python -m gpfast.build > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; } ;;
    tests) CUDA_VISIBLE_DEVICES=$G timeout 200 python -m pytest tests -q -m cuda -p no:cacheprovider \
             > "$OUT/tests.log" 2>&1; tail -15 "$OUT/tests.log" ;;
    tests_dist) timeout 150 python -m pytest tests/test_distributed.py -q -m cuda -p no:cacheprovider \
             > "$OUT/tests_dist.log" 2>&1; tail -15 "$OUT/tests_dist.log" ;;
    sanitize)
      for tool in memcheck racecheck; do
        CUDA_VISIBLE_DEVICES=$G timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python -m experiments.sanitize_ops \
          > "$OUT/sanitize_$tool.log" 2>&1; echo "$tool rc=$?"; tail -3 "$OUT/sanitize_$tool.log"
      done ;;
    bench_ops) CUDA_VISIBLE_DEVICES=$G timeout 150 python -m experiments.bench_ops --reps 5 > "$OUT/bench_ops.log" 2>&1
               tail -14 "$OUT/bench_ops.log" ;;
    bench_matmul) CUDA_VISIBLE_DEVICES=$G timeout 120 python -m experiments.bench_matmul --sizes 40000 200000 1000000 \
                  --reps 3 > "$OUT/bench_matmul.log" 2>&1; tail -8 "$OUT/bench_matmul.log" ;;
    bench_matmul_rhs) CUDA_VISIBLE_DEVICES=$G timeout 200 python -m experiments.bench_matmul --sizes 40000 \
                  --t 16 64 256 1024 4000 --reps 3 --stem bench_matmul_rhs > "$OUT/bench_matmul_rhs.log" 2>&1
                  tail -10 "$OUT/bench_matmul_rhs.log" ;;
    scaling1m) CUDA_VISIBLE_DEVICES=$G timeout 300 python -m experiments.scaling --sizes 1000000 --gpytorch-max 40000 \
               --reps 1 --keep > "$OUT/scaling.log" 2>&1; tail -12 "$OUT/scaling.log" ;;
    dist1|dist2) k=${st#dist}; vis=$G; [ "$k" = 2 ] && vis=${CUDA_VISIBLE_DEVICES:-0,1}
      CUDA_VISIBLE_DEVICES=$vis timeout ${DIST_TIMEOUT:-400} torchrun --nproc-per-node=$k --master-port=2960$k -m experiments.bench_distributed \
        --sizes ${DIST_SIZES:-1000000 2000000} --reps 1 --train-iter > "$OUT/dist$k.log" 2>&1; tail -4 "$OUT/dist$k.log" ;;
    distfit) timeout 60 torchrun --nproc-per-node=2 --master-port=29603 -m gpfast fit --dataset yacht --iters 5 \
             --solver cg --device cuda --distributed --quiet > "$OUT/distfit.log" 2>&1; tail -6 "$OUT/distfit.log" ;;
    tests_engine) CUDA_VISIBLE_DEVICES=$G timeout 300 python -m pytest tests/test_train.py tests/test_operator.py -q -m cuda \
             -p no:cacheprovider > "$OUT/tests_engine.log" 2>&1; tail -15 "$OUT/tests_engine.log" ;;
    engine_uci_a|engine_uci_b|engine_uci_c)
      case "$st" in engine_uci_a) sets="pol elevators bike kin40k" ;; engine_uci_b) sets="protein keggdirected" ;;
                    *) sets="keggundirected" ;; esac
      stem="uci_engine_$(echo $sets | tr ' ' _)_bc"
      CUDA_VISIBLE_DEVICES=$G timeout ${UCI_TIMEOUT:-540} python -m experiments.uci_table --data-dir .data/uci \
        --device cuda --splits 0 --iters 50 --lr 0.1 --quiet --datasets $sets --rows gpytorch+gpfast gpfast \
        --stem "$stem" --out "$OUT" > "$OUT/$stem.log" 2>&1; tail -16 "$OUT/$stem.log" ;;
    stored_product) CUDA_VISIBLE_DEVICES=$G timeout 180 python -m experiments.bench_stored_product --n 36000 --t 11 \
             --reps 20 --out "$OUT" > "$OUT/stored_product.log" 2>&1; tail -10 "$OUT/stored_product.log" ;;
    engine1m) CUDA_VISIBLE_DEVICES=$G timeout 540 python -m experiments.engine_step --n 1000000 --d 8 --steps 3 \
             --out "$OUT" > "$OUT/engine1m.log" 2>&1; tail -12 "$OUT/engine1m.log" ;;
    uci:*)
      IFS=: read -r _ sets rows <<< "$st"
      rows=${rows:-gpytorch,gpytorch+gpfast,gpfast}
      letters=$(echo ",$rows," | sed -e 's/,gpytorch+gpfast,/,b,/g; s/,gpytorch,/,a,/g; s/,gpfast,/,c,/g' | tr -d ,)
      stem="uci_${sets//,/_}_${letters}"
      CUDA_VISIBLE_DEVICES=$G timeout ${UCI_TIMEOUT:-580} python -m experiments.uci_table --data-dir .data/uci \
        --device cuda --splits 0 --iters 50 --quiet --datasets ${sets//,/ } --rows ${rows//,/ } --stem "$stem" \
        > "$OUT/$stem.log" 2>&1; tail -14 "$OUT/$stem.log" ;;
    *) echo "unknown stage $st"; exit 2 ;;
  esac
done
log done
