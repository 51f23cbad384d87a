#!/usr/bin/env bash
# The GPU machine's work in named stages, so that one lease runs several of them (some side by side on two GPUs).
# Usage (repo root, UCI data copied to .data/uci): bash experiments/run_h200.sh OUTDIR [--commit SHA] STAGE [STAGE ...]
# Stages: build, tests, tests_dist, sanitize, bench_ops, bench_matmul, bench_matmul_rhs, scaling1m, dist1, dist2, distfit,
#         uci:SET[,SET...][:ROW[,ROW]]  (ROW: gpytorch, gpytorch+gpfast, gpfast; stem uci_<sets>_<a|b|c letters>),
#         gpfast's training engine (results and logs in OUTDIR): tests_engine, engine_uci_a, engine_uci_b,
#         engine_uci_c (rows b and c on pol/elevators/bike/kin40k, protein/keggdirected, keggundirected), stored_product,
#         engine1m,
#         fit1m (ExactGP on 1M synthetic points, d=8, 50 Adam steps, then 10k test points; resumable, call
#                it again until its log ends "fit1m: done", see below),
#         kernels (every CUDA kernel check in one call; KERNELS_BUDGET seconds, default 540, see below),
#         perf (the stored-K product kernel and the backward's copy pipeline; PERF_BUDGET seconds, default 345),
#         round (everything changed since the last GPU run, in value order; ROUND_BUDGET seconds, default 420),
#         verify (build, CUDA tests, sanitizers, CG prediction vs Cholesky at 100k, bench_ops; VERIFY_BUDGET 560),
#         accuracy (engine and CG-posterior CUDA tests, CG prediction vs Cholesky at 100k, UCI rows c and exact on
#                   the four smaller sets, step_anatomy; ACCURACY_BUDGET 560), accuracy_large (row exact on
#                   keggdirected, CG prediction at 1M),
#         engine (CUDA graphs in the engine: tests, row c on the seven sets, step_anatomy, row exact on protein;
#                 ENGINE_BUDGET 570), tensor_cores (the tensor-core kernels and the pivot kernel: every CUDA test,
#                 row c on the seven sets, bench_bilinear, step_anatomy, bench_tensor_cores; TC_BUDGET 585),
#         backward_rank (the tensor-core backward's tests and sweep, row c on the seven sets and at preconditioner
#                 ranks 1600 and 3200 on kin40k and protein, the CG posterior's cost parts at 1M; BR_BUDGET 570),
#         batched_rank (batched_gps on the GPU, row c on the seven sets, the CUDA tests; BAR_BUDGET 570),
#         rank_compare (row c on the seven sets at rank limits 3200 and 800, the engine's CUDA tests, the private
#                 backward op's argument errors one process each, memcheck; RC_BUDGET 570),
#         fixes (the private backward op's argument errors, every CUDA test, the CG posterior's 1M cost parts;
#                 FIX_BUDGET 540),
#         engine_check (build, the CUDA tests of the pivot blocks, graphs, engine and CG posterior, row c on bike;
#                 CHECK_BUDGET 300), session3 (every CUDA test, bench_inverse, row c on the seven sets, row exact on
#                 keggdirected, batched stored products; S3_BUDGET 585), session3c (step_anatomy, memcheck, racecheck;
#                 S3C_BUDGET 585), session3d (the engine's tests, exact_step, row c on the seven sets; S3D_BUDGET
#                 585), session3e (row exact on keggdirected, the CG posterior's 1M cost parts; S3E_BUDGET 585),
#                 session3f (exact_row_probe on keggdirected, the CG posterior's cost parts at 200k; S3F_BUDGET 250),
#         exact_kegg (row exact on the sets in EXACT_SETS, default keggdirected; EK_BUDGET 585),
#         session4a (row exact on keggdirected, row c on the seven sets, the CG posterior's 1M cost parts; S4A_BUDGET
#                 585), session4b (row exact on keggundirected, step_anatomy; S4B_BUDGET 585),
#         session4c (the pivoted Cholesky's operations one by one at 200k and 1M, the CG posterior's 1M cost parts;
#                 S4C_BUDGET 520), session5 (the pivoted Cholesky's CUDA tests, the CG posterior's 1M cost parts,
#                 row c on the seven sets; S5_BUDGET 585), session6 (the CUDA tests of the graphs, pivoted Cholesky
#                 and engine, step_anatomy, row c on the seven sets, memcheck, racecheck; S6_BUDGET 585), session6b
#                 (bench_preconditioner on keggdirected and pol, every CUDA test; S6B_BUDGET 585), session6c (the
#                 CUDA tests of the graphs, pivoted Cholesky, engine and checkpoints, row c on the seven sets,
#                 step_anatomy, keggdirected's row c twice more, bench_preconditioner; S6C_BUDGET 585), session6d
#                 (the CUDA tests of the pivoted Cholesky and graphs, row c on the seven sets, step_anatomy on
#                 ANATOMY_SETS; S6D_BUDGET 330), session7 (the CUDA tests of the pivoted Cholesky, graphs, engine and
#                 checkpoints, row c on the seven sets at 16 and at 32 pivots a block, step_anatomy; S7_BUDGET 585),
#                 session8c (K @ V on tensor cores: every CUDA test, sanitizers over K @ V, the kernel sweep, its
#                 instruction mix, the 1M step; S8C_BUDGET 585), session9 (the float32 covariance backward: its
#                 tests, bench_ops with both row passes, sanitizers over them, every CUDA test; S9_BUDGET 585), session9b
#                 (the one-pass float32 backward: its tests, bench_ops, Nsight Compute, sanitizers, every CUDA test;
#                 S9B_BUDGET 585), session9c (backward_f32_probe, the backward's tests, bench_ops; S9C_BUDGET 400),
#                 session9d (the float32 backward as it lands: tests, probe, sanitizers, bench_ops, every CUDA test;
#                 S9D_BUDGET 540), session10 (the tensor-core forward and rebuilds that wait for their cost:
#                 forward tests, bench_ops, row c at rebuild_cost_share 1 and 0, sanitizers, engine tests; S10_BUDGET
#                 575), session10b (the tensor-core forward, columns in registers: forward tests, bench_ops, row c,
#                 sanitizers, every CUDA test; S10B_BUDGET 560), session10c (what lands: every CUDA test,
#                 row c, step_anatomy on two sets; S10C_BUDGET 470), session11a (where the d > 16 sets' steps go:
#                 step_anatomy with its kernel list at the default forward and with the expansion forced, bench_ops
#                 on the preconditioner's thin row blocks, Nsight Compute of the tensor-core forward; S11A_BUDGET 460),
#                 session11b (the expansion the default forward again: every CUDA test, row c, bench_ops on clustered
#                 points, step_anatomy; S11B_BUDGET 480), session11c (step_anatomy after 20 steps on the seven sets,
#                 and on the kegg sets with the forward by differences; S11C_BUDGET 330), session11d (float32's
#                 24- and 28-feature forward: every CUDA test, bench_ops, row c, bench_ops on clustered points;
#                 S11D_BUDGET 460), session12a (the engine's gradient from the stored K and the symmetric forward:
#                 their tests, bench_bilinear, row c, step_anatomy with and without the symmetric forward,
#                 sanitizers over them; S12A_BUDGET 585), session12b (the symmetric forward the engine's default: the
#                 engine's and stored_backward's CUDA tests, row c, step_anatomy; S12B_BUDGET 420), session13a
#                 (the product reading half of K(x, x): build, its tests, bench_symmetric_product, step_anatomy with
#                 and without it, row c, sanitizers; S13A_BUDGET 585), session13b (the preconditioner's products
#                 by the bandwidth kernel and the half-read product for more than 12 columns only: Nsight Compute
#                 on the half-read kernel, the engine's CUDA tests, bench_symmetric_product, step_anatomy, row c,
#                 racecheck over the half-read kernel; S13B_BUDGET 585), session14a (the pivoted Cholesky's
#                 selection and pivots in two kernels a block: build, their tests and the engine's, memcheck and
#                 racecheck over them, bench_preconditioner on keggdirected and pol, step_anatomy, row c;
#                 S14A_BUDGET 585), session14b (step_anatomy and row c again, after a change to the rebuild model;
#                 S14B_BUDGET 300), session14c (every CUDA test and memcheck over every kernel on a carried build;
#                 S14C_BUDGET 400), session14d (racecheck over every kernel on a carried build; S14D_BUDGET 260),
#                 session15 (the rebuild rule on the iterations a preconditioner's ageing added, the larger CUDA
#                 warm-up and the fit's phases: build, the engine's and the estimator's CUDA tests, row c, row a,
#                 row c rebuilding whenever asked; S15_BUDGET 560), session15b (row c by the first form of the
#                 deferral rule, with .gpb/state_first_rule.py in a copy of the tree, and rebuilding whenever asked,
#                 then the current rule again, on a carried build; S15B_BUDGET 330), session16 (the covariance
#                 backward from the forward's K: build, every CUDA test, bench_ops with the backward op, the two
#                 accuracy probes, memcheck over the backward's kernels, row b on pol, elevators and bike;
#                 S16_BUDGET 570), session16b (every CUDA test, the tensor-core (l, s) backward's probe with the
#                 tests' rule, racecheck over the covariance backward's kernels, on a carried build; S16B_BUDGET 330),
#                 session16c (row c on the seven sets, on a carried build; S16C_BUDGET 150), session17 (build,
#                 every CUDA test, memcheck over every kernel; S17_BUDGET 560), session17b (racecheck over every
#                 kernel on a carried build; S17B_BUDGET 300), session18 (row c under five engine settings:
#                 the defaults, pivot_block 32, max_preconditioner_rank 1600, both, and pivot_block 32 with
#                 rescale_change 0.3; then step_anatomy with the device's waits; on a carried build;
#                 S18_BUDGET 560), session18b (the engine's new defaults, 32 pivots a block and the rank limit
#                 within n / 8: every CUDA test, row c, step_anatomy with the device's waits; on a carried build;
#                 S18B_BUDGET 540), session19 (the fit's steps by the engine's natural path with gpfast's Adam:
#                 row c, the kept CG graph's tests and its row c (cuda_graph_reuse), cg_graph_cost,
#                 step_anatomy, every CUDA test; on a carried build; S19_BUDGET 580), session20 (no synchronous
#                 host-to-device copies inside a step: row c before and after, and with the kept CG graph;
#                 step_anatomy with and without it; the kept graph's tests, cg_graph_cost, every CUDA test;
#                 S20_BUDGET 560), session20b (every CUDA test with the kept CG graph the default;
#                 S20B_BUDGET 320), session21 (row c, step_anatomy and every CUDA test; S21_BUDGET 460),
#                 session21b (the gram and the posterior's Cholesky by blocks, against the tree before; S21B_BUDGET
#                 420), session21c (every CUDA test, row c, step_anatomy; S21C_BUDGET 400), session21d (the CUDA
#                 tests of the review mends' files; S21D_BUDGET 150), session22 (rows a, training only, and c on the
#                 seven sets; those tests; step_anatomy; S22_BUDGET 480), session22b (preconditioner forms on protein
#                 and kin40k; Nsight Compute over K @ V's tensor-core kernel and the covariance forward; S22B_BUDGET 480),
#                 session22c (K @ V's tensor-core variants with two row tiles a warp or grouped compensated sums: the
#                 benchmark at 10^6 points, their CUDA tests, memcheck; S22C_BUDGET 560), session22d (the two-tile
#                 default: every CUDA test, the benchmark, the 1M engine step; S22D_BUDGET 580), session22e (Nsight
#                 Compute over the two-tile default; S22E_BUDGET 120), session23 (the pivoted Cholesky's block
#                 kernels: their tests, sanitizers, Nsight Compute, row c before and after, step_anatomy; S23_BUDGET 560),
#                 session23b (the same after the kernels' second form; S23B_BUDGET 540), session23c (the update with
#                 all rows in flight; row c before and after twice on the small sets, rows a and c end to end there;
#                 S23C_BUDGET 600), session23d (the pivot mends' CUDA tests and memcheck; S23D_BUDGET 230),
#                 session24a (the preconditioner's factor in float16: its tests, memcheck, row c with and without it
#                 twice, step_anatomy; S24A_BUDGET 590), session24b (K @ V's tensor-core kernel with the exponent's
#                 biases in the MMAs' accumulators and with the shifted exponent: the benchmark at 10^6 points, the
#                 op-error cases, the CUDA tests session24a's crash cut short, the K @ V CUDA tests, memcheck;
#                 S24B_BUDGET 580), session24c (the biases-in-accumulators default: every CUDA test, the benchmark,
#                 the 1M engine step; S24C_BUDGET 540), session25a (GPyTorch's loop with gpfast's kernels returning a
#                 DenseRBFOperator: build, the operator's CUDA tests, rows a and b, gpytorch_step, two K @ V variants;
#                 S25A_BUDGET 590), session26a (rows a and c on the seven sets, step_anatomy, racecheck and memcheck
#                 over every kernel, the 1M engine step; S26A_BUDGET 580), session26b (what session25a's shortened run left:
#                 the operator's CUDA tests, rows a and b on the seven sets, gpytorch_step, the K @ V variants;
#                 S26B_BUDGET 590)
# Single-GPU stages run on GPU $GPU (default 0), so two chains can run side by side on a two-GPU machine.
# --commit names the commit being measured (the GPU machine's copy of the tree has no .git), e.g. from
# `git describe --always --dirty` on the host: it goes to the file COMMIT at the repository root, which the results
# tables read (gpfast.bench.timing.git_rev); without it they say "unknown".
# Each stage has its own time limit so that one slow stage cannot take the others' results with it.
set -u
[ $# -ge 2 ] || { echo "usage: $0 OUTDIR [--commit SHA] STAGE [STAGE ...]" >&2; exit 2; }
OUT=$1; shift
if [ "$1" = "--commit" ]; then
  [ $# -ge 3 ] || { echo "usage: $0 OUTDIR [--commit SHA] STAGE [STAGE ...]" >&2; exit 2; }
  echo "$2" > COMMIT; shift 2
elif [ ! -d .git ] && [ ! -s COMMIT ]; then
  echo "warning: no .git and no --commit; results will name no commit" >&2
fi
mkdir -p "$OUT"
# A compiled library brought back by an earlier call (OUTDIR/gpb.tgz, carried as .gpb/gpb.tgz) is unpacked into the
# build cache: used where its sources' key matches, ignored otherwise (gpfast/_build.py).
[ -s .gpb/gpb.tgz ] && mkdir -p /tmp/gpb && tar xzf .gpb/gpb.tgz -C /tmp/gpb
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GPFAST_BUILD_DIR=/tmp/gpb MAX_JOBS=16 NCCL_NVLS_ENABLE=0
G=${GPU:-0}
log() { echo "== $* ($(date +%T))"; }
# Budgeted stages (kernels, round, perf): budget_start SECONDS at the stage's start, then brun CAP LOG CMD... runs
# CMD on GPU $G with the smaller of CAP and what is left of the budget, appending to LOG; under 15 s left it is
# skipped (rc 124), so that the whole stage stays inside one call.
budget_start() { B_BUDGET=$1; B_T0=$SECONDS; }
# Stages with a results folder: stage_begin NAME BUDGET [BUILD_CAP] starts the budget, builds for sm_90 (log, with
# ptxas's registers and spills: $OUT/NAME_build.log; the architecture is part of the build's cache key, so the tests
# and benchmarks reuse it) and makes $res = $OUT/NAME_results; stage_end NAME packs $res into NAME_results.tar.gz
# (one file: the transfer limits count files) and says the stage's time.
stage_begin() {
  budget_start "$2"
  export TORCH_CUDA_ARCH_LIST=9.0
  res="$OUT/$1_results"; mkdir -p "$res"
  brun "${3:-240}" "$OUT/$1_build.log" python -m gpfast.build --verbose || { tail -40 "$OUT/$1_build.log"; exit 1; }
  echo "build done at $(( SECONDS - B_T0 )) s"
}
stage_end() { tar czf "$OUT/$1_results.tar.gz" -C "$OUT" "$1_results" && rm -rf "$res"; echo "$1: $(( SECONDS - B_T0 )) s"; }
# pack_logs NAME: the stage's logs ($OUT/NAME_*.log) into one file, NAME_logs.tar.gz (the transfer limits count files).
pack_logs() { tar czf "$OUT/$1_logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls "$1"_*.log) && rm -f "$OUT"/"$1"_*.log; }
# The UCI rows' common arguments: split 0, 50 Adam steps at lr 0.1, the data carried to .data/uci.
UCI=(python -m experiments.uci_table --data-dir .data/uci --device cuda --splits 0 --iters 50 --lr 0.1 --quiet)
brun() {
  local cap=$1 logf=$2 left=$(( B_BUDGET - (SECONDS - B_T0) )); shift 2
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 15 ]; then echo "skipped (budget spent): $*" | tee -a "$logf"; return 124; fi
  echo "== $* (limit ${cap}s, $(date +%T))" >> "$logf"
  CUDA_VISIBLE_DEVICES=$G timeout "$cap" "$@" >> "$logf" 2>&1
}
# Steps that several stages share (each within the stage's budget, results in $res):
# row_c LOG CAP [STEM [ARG...]]: row c (gpfast's engine) on the seven UCI sets (results stem STEM, default
# uci_all_c; ARG... passed on, e.g. --cg FIELD=VALUE), its main columns and the ConvergenceWarnings seen in LOG.
row_c() {
  local logf=$1 cap=$2 stem=${3:-uci_all_c}; shift $(( $# < 3 ? $# : 3 ))
  brun "$cap" "$logf" "${UCI[@]}" --rows gpfast "$@" --stem "$stem" --out "$res"; echo "uci c $stem rc=$?"
  row_c_columns "$res/$stem.md"
  echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$logf")"
}
# row_c_columns TABLE: a row c table's main columns (set, train s, ms/step, CG it/step, RMSE, NLL, status, outside
# steps s).
row_c_columns() { grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$1" | cut -d'|' -f2,7,9,10,12,13,23,24; }
# row_c_before LOG CAP: row c of the tree before a change (results stem uci_all_c_before), when it was unpacked
# beforehand into .gpb/old by `git archive SHA gpfast experiments ':!experiments/results' | tar x -C .gpb/old` and
# `echo SHA > .gpb/old/COMMIT` (which its tables name); nothing without it.
row_c_before() {
  [ -d .gpb/old/gpfast ] || return 0
  (cd .gpb/old && PYTHONPATH=$PWD brun "$2" "$1" python -m experiments.uci_table --data-dir ../../.data/uci \
    --device cuda --splits 0 --iters 50 --lr 0.1 --quiet --rows gpfast --stem uci_all_c_before --out "$res")
  echo "uci c before rc=$?"
  row_c_columns "$res/uci_all_c_before.md"
}
# pack_build: the compiled library as OUTDIR/gpb.tgz, for a later call to carry as .gpb/gpb.tgz.
pack_build() { tar czf "$OUT/gpb.tgz" -C /tmp/gpb --exclude='*.lock' . && ls -la "$OUT/gpb.tgz"; }
# sanitizer TOOL LOG CAP ARG...: compute-sanitizer's TOOL over experiments.sanitize_ops ARG... under CAP, and its
# summary.
sanitizer() {
  local tool=$1 logf=$2 cap=$3; shift 3
  brun "$cap" "$logf" compute-sanitizer --tool "$tool" --error-exitcode 3 python -m experiments.sanitize_ops "$@"
  echo "$tool rc=$?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|ran|Error" "$logf" | tail -4
}
# sanitizers LOG CAP ARG...: memcheck, then racecheck, over experiments.sanitize_ops ARG... (each under CAP).
sanitizers() {
  local logf=$1 cap=$2; shift 2
  for tool in memcheck racecheck; do sanitizer "$tool" "$logf" "$cap" "$@"; done
}
# cuda_tests LOG CAP FILE...: the CUDA tests of FILE... (or the folder tests), their failures and summary line.
cuda_tests() {
  local logf=$1 cap=$2; shift 2
  brun "$cap" "$logf" python -m pytest -q -m cuda -p no:cacheprovider "$@"; echo "tests rc=$?"
  grep -E "^(FAILED|ERROR)|Fatal|Segmentation" "$logf" | head -20; tail -1 "$logf"
}
# kv_kernels LOG CAP STEM "SIZES" KERNEL...: bench_matmul's named K @ V kernels at each of SIZES points (medians of 3)
# into $res/STEM_kernels.{md,json}, and its table.
kv_kernels() {
  local logf=$1 cap=$2 stem=$3 sizes=$4; shift 4
  # shellcheck disable=SC2086  # SIZES is a list of numbers
  brun "$cap" "$logf" python -m experiments.bench_matmul --sizes $sizes --reps 3 --stem "$stem" --kernels "$@"
  echo "bench_matmul rc=$?"; cp experiments/results/"$stem"_kernels.* "$res/" 2>/dev/null
  grep -E "^\| " "$res/${stem}_kernels.md"
}
# anatomy LOG CAP [ARG...]: step_anatomy on the UCI sets (ARG... passed on, e.g. --datasets or --steps; results
# stem $ANATOMY_STEM, default step_anatomy), then its table, its launches by part and its kernels.
# On an H100 (the device tool may lend one for an H200) the floor takes the H100's measured copy rate, 3.0 TB/s.
anatomy() {
  local logf=$1 cap=$2 stem=${ANATOMY_STEM:-step_anatomy} bw=(); shift 2
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && bw=(--bandwidth 3.0e12)
  brun "$cap" "$logf" python -m experiments.step_anatomy --device cuda --data-dir .data/uci --out "$res" --stem "$stem" \
    ${bw[@]+"${bw[@]}"} "$@"
  echo "step_anatomy rc=$?"; grep -E "^(\| |- )" "$res/$stem.md" | tail -24
}
# exact_row LOG SET CAP: row exact (50 Adam steps with float64 Cholesky gradients) on one UCI set.
exact_row() {
  brun "$3" "$1" "${UCI[@]}" --datasets "$2" --rows exact --stem "uci_$2_exact" --out "$res"
  echo "exact $2 rc=$?"; grep -E "^\| kegg" "$1" | cut -d'|' -f2,5,7,8,12,13
}
# cg1m_parts LOG CAP: the CG posterior's cost parts at 1M points and 10,000 test points (set-up part by part).
cg1m_parts() {
  brun "$2" "$1" python -m experiments.cg_prediction --pieces 1000000 --test 10000 --cg-iters 20 \
    --stem cg_prediction_pieces_1m --out "$res"; echo "cg_prediction pieces rc=$?"; tail -12 "$1"
}
# ncu_pages LOG CAP STEM ARG...: Nsight Compute's full set over `python -m experiments.profile_ops ARG...` under CAP,
# kept as text: $res/STEM_details.txt (every kernel's details page) and $res/STEM_sass.csv (its SASS with
# per-instruction counters); the report itself is deleted, since it can be too large to come back. $NCU_FILTER, when
# set, adds ncu options (which kernels, how many).
# ncu_pivot LOG SKIP COUNT: ncu_pages over a rank-1600 build at pol's shape (profile_ops --op pivot), COUNT launches
# of the pivot kernels after the first SKIP (three a block: update, selection, pivots), and their main figures.
ncu_pivot() {
  NCU_FILTER="--kernel-name regex:pivot_ --launch-skip $2 --launch-count $3" ncu_pages "$1" 90 ncu_pivot --op pivot
  grep -E "pivot_|Duration|Registers Per|Issue Slots Busy|Executed Ipc A|No Eligible|Achieved Occupancy" \
    "$res/ncu_pivot_details.txt" | head -$(( 8 * $3 ))
}
ncu_pages() {
  local logf=$1 cap=$2 stem=$3 ncu_bin; shift 3
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # shellcheck disable=SC2086  # NCU_FILTER: more ncu options (e.g. --kernel-name, --launch-count), word-split
  brun "$cap" "$logf" "$ncu_bin" --profile-from-start off --clock-control none --set full --import-source no \
    ${NCU_FILTER:-} -f -o "$res/$stem" python -m experiments.profile_ops "$@"
  echo "ncu $stem rc=$?"
  "$ncu_bin" -i "$res/$stem.ncu-rep" --page details > "$res/${stem}_details.txt" 2>&1
  "$ncu_bin" -i "$res/$stem.ncu-rep" --page source --print-source sass --csv > "$res/${stem}_sass.csv" 2>&1
  rm -f "$res/$stem.ncu-rep"
}
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
    fit1m)
      # One chunk of at most FIT1M_TIMEOUT (default 540) seconds of experiments/fit1m.py, resuming from .ckpt/fit1m/
      # (git-ignored; it stays on a warm machine between calls). rc=124: the chunk was cut, call the stage again;
      # the log ends "fit1m: done" once the results are in $OUT/fit1m.{md,json}. The state (~50 MB) is copied to
      # $OUT/fit1m_state: on a fresh machine, put it back in .ckpt/fit1m and carry .ckpt to resume there.
      mkdir -p .ckpt/fit1m
      CUDA_VISIBLE_DEVICES=$G timeout ${FIT1M_TIMEOUT:-540} python -m experiments.fit1m --state .ckpt/fit1m --out "$OUT" \
        --quiet >> "$OUT/fit1m.log" 2>&1
      echo "fit1m rc=$? (124: cut at ${FIT1M_TIMEOUT:-540} s; call the stage again to resume)" | tee -a "$OUT/fit1m.log"
      mkdir -p "$OUT/fit1m_state"; cp .ckpt/fit1m/* "$OUT/fit1m_state/" 2>/dev/null; tail -14 "$OUT/fit1m.log" ;;
    uci:*)
      IFS=: read -r _ sets rows <<< "$st"
      rows=${rows:-gpytorch,gpytorch+gpfast,gpfast}
      letters=$(echo ",$rows," | sed -e 's/,gpytorch+gpfast,/,b,/g; s/,gpytorch,/,a,/g; s/,gpfast,/,c,/g' | tr -d ,)
      stem="uci_${sets//,/_}_${letters}"
      CUDA_VISIBLE_DEVICES=$G timeout ${UCI_TIMEOUT:-580} python -m experiments.uci_table --data-dir .data/uci \
        --device cuda --splits 0 --iters 50 --quiet --datasets ${sets//,/ } --rows ${rows//,/ } --stem "$stem" \
        > "$OUT/$stem.log" 2>&1; tail -14 "$OUT/$stem.log"; cp experiments/results/"$stem".* "$OUT/" 2>/dev/null ;;
    kernels)
      # Build for sm_90, every CUDA test, bench_ops and bench_matmul at the target shapes, compute-sanitizer
      # memcheck and racecheck over experiments/sanitize_ops.py, then a summary table. Each step gets its own limit,
      # cut to what is left of KERNELS_BUDGET, so that the whole stage stays under one 10-minute call (the sanitizers
      # come last: should the budget run out, the sanitize stage reruns them on their own). Files in $OUT:
      # kernels_{build,tests,sanitize,bench}.log and bench_{ops,matmul}.{md,json} (also in experiments/results).
      budget_start ${KERNELS_BUDGET:-540}
      export TORCH_CUDA_ARCH_LIST=9.0  # part of the build's cache key: the tests and benchmarks reuse this build
      brun 240 "$OUT/kernels_build.log" python -m gpfast.build --verbose \
        || { tail -40 "$OUT/kernels_build.log"; exit 1; }
      echo "ptxas: $(grep -c 'bytes spill stores' "$OUT/kernels_build.log") kernels," \
        "$(grep 'bytes spill stores' "$OUT/kernels_build.log" | grep -vc ' 0 bytes spill stores') with spills"
      brun 200 "$OUT/kernels_tests.log" python -m pytest tests -q -m cuda -p no:cacheprovider; echo "tests rc=$?"
      tail -4 "$OUT/kernels_tests.log"
      brun 90 "$OUT/kernels_bench.log" python -m experiments.bench_ops --quick --reps 5; echo "bench_ops rc=$?"
      brun 130 "$OUT/kernels_bench.log" python -m experiments.bench_matmul --cases 1000000:16 36000:11 36000:12 \
        --backward --reps 3; echo "bench_matmul rc=$?"
      for tool in memcheck racecheck; do  # racecheck over every kernel took 74 s alone on the H200: give it 150
        brun $([ $tool = racecheck ] && echo 150 || echo 75) "$OUT/kernels_sanitize.log" \
          compute-sanitizer --tool $tool --error-exitcode 3 python -m experiments.sanitize_ops
        rc=$?; echo "$tool rc=$rc" | tee -a "$OUT/kernels_sanitize.log"; echo "$tool rc=$rc" >> "$OUT/kernels_sanitize.rc"
      done
      tail -6 "$OUT/kernels_sanitize.log"
      cp experiments/results/bench_ops.md experiments/results/bench_ops.json experiments/results/bench_matmul.md \
        experiments/results/bench_matmul.json "$OUT/" 2>/dev/null
      san=$(tr '\n' ' ' < "$OUT/kernels_sanitize.rc" 2>/dev/null); rm -f "$OUT/kernels_sanitize.rc"
      timeout 30 python - "$OUT" "$(tail -1 "$OUT/kernels_tests.log")" "$san" "$(( SECONDS - B_T0 ))" <<'PYEOF'
import json, sys
from pathlib import Path
out, tests, san, took = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def load(name):
    try:
        return json.loads((out / name).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []
ops_rows = {r["shape"]: r for r in load("bench_ops.json")}
mm_rows = {(r["n"], r["t"]): r for r in load("bench_matmul.json")}
def num(v):
    return v if isinstance(v, (int, float)) else float("nan")
lines = []
for shape, name in (("(1,16384,16384,8)", "fwd d=8 n=16384"), ("(1,40000,40000,8)", "fwd d=8 n=40000"),
                    ("(4,8192,8192,32)", "fwd d=32")):
    r = ops_rows.get(shape, {})
    target = "<= 2.7" if "32" in name else "<= 1.25"
    lines.append((f"{name}, x floor", num(r.get("gpfast_fwd", 0)) / num(r.get("floor_ms", 0) or float("nan")), target))
for shape, name, target in (("(1,16384,16384,8)", "fwd+bwd vs GPyTorch, d=8 n=16384", ">= 10"),
                            ("(1,40000,40000,8)", "fwd+bwd vs GPyTorch, d=8 n=40000", ">= 10"),
                            ("(4,8192,8192,32)", "fwd+bwd vs GPyTorch, d=32", ">= 3")):
    r = ops_rows.get(shape, {})
    lines.append((name + ", x faster", num(r.get("gpytorch_fwd_bwd")) / num(r.get("gpfast_fwd_bwd", float("nan"))), target))
r = mm_rows.get((1000000, 16), {})
lines.append(("K@V 1M d=8 t=16, s", num(r.get("gpfast_s")), "<= 1.2"))
lines.append(("K@V fwd+bwd 1M (all grads), s", num(r.get("gpfast_fwd_bwd_s")), "<= 2"))
lines.append(("K@V fwd+bwd 1M (l, s only), s", num(r.get("gpfast_fwd_bwd_theta_s")), "-"))
for t in (11, 12):
    r = mm_rows.get((36000, t), {})
    lines.append((f"K@V 36k t={t}: fwd / fwd+bwd (l, s), ms",
                  f"{num(r.get('gpfast_s')) * 1e3:.2f} / {num(r.get('gpfast_fwd_bwd_theta_s')) * 1e3:.2f}", "-"))
print(f"\nkernels stage summary ({took} s). tests: {tests.strip()} | sanitizer: {san.strip()}")
print(f"| {'what':44s} | {'measured':>16s} | target |")
for name, val, target in lines:
    v = f"{val:.3g}" if isinstance(val, float) else str(val)
    print(f"| {name:44s} | {v:>16s} | {target} |")
PYEOF
      ;;
    round)
      # One call's worth of everything that changed since the last GPU run, most valuable first, within ROUND_BUDGET
      # seconds (default 420): build for sm_90, every CUDA test, compute-sanitizer memcheck and racecheck (also
      # over the stored-K product and both backward variants), gpfast.ExactGP (row c) on pol, elevators, bike and
      # kin40k, bench_ops at the target shapes with both backward variants, the stored product at n = 36k, then
      # row c on protein and keggdirected. Files in $OUT: round_*.log and the benchmarks' md/json/csv under
      # $OUT/round_results.tar.gz (unpack into experiments/results).
      budget_start ${ROUND_BUDGET:-420}
      export TORCH_CUDA_ARCH_LIST=9.0
      res="$OUT/round_results"; mkdir -p "$res"
      brun 240 "$OUT/round_build.log" python -m gpfast.build --verbose || { tail -40 "$OUT/round_build.log"; exit 1; }
      echo "build done at $(( SECONDS - B_T0 )) s"
      brun 120 "$OUT/round_tests.log" python -m pytest tests -q -m cuda -p no:cacheprovider; echo "tests rc=$?"
      tail -4 "$OUT/round_tests.log"
      for tool in memcheck racecheck; do
        brun 60 "$OUT/round_sanitize.log" compute-sanitizer --tool $tool --error-exitcode 3 python -m experiments.sanitize_ops
        echo "$tool rc=$?"
      done
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all kernels ran" "$OUT/round_sanitize.log"
      brun 150 "$OUT/round_uci.log" python -m experiments.uci_table --data-dir .data/uci --device cuda --splits 0 \
        --iters 50 --quiet --datasets pol elevators bike kin40k --rows gpfast --stem uci_pol_elevators_bike_kin40k_c \
        --out "$res"; echo "uci rc=$?"; grep -E "^   gpfast|^== " "$OUT/round_uci.log"
      brun 80 "$OUT/round_bench.log" python -m experiments.bench_ops --quick --reps 5 --bwd-op \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8; echo "bench_ops rc=$?"
      cp experiments/results/bench_ops.md experiments/results/bench_ops.json "$res/" 2>/dev/null
      brun 60 "$OUT/round_bench.log" python -m experiments.bench_stored_product --n 36000 --t 11 --reps 20 --out "$res"
      echo "stored product rc=$?"; grep -E "^\| |fastest" "$OUT/round_bench.log" | tail -12
      brun 200 "$OUT/round_uci.log" python -m experiments.uci_table --data-dir .data/uci --device cuda --splits 0 \
        --iters 50 --quiet --datasets protein keggdirected --rows gpfast --stem uci_protein_keggdirected_c \
        --out "$res"; echo "uci (protein, keggdirected) rc=$?"; grep -E "^   gpfast|^== " "$OUT/round_uci.log" | tail -4
      tar czf "$OUT/round_results.tar.gz" -C "$OUT" round_results && rm -rf "$res"  # one file: the transfer limits counts
      echo "round: $(( SECONDS - B_T0 )) s" ;;
    perf)
      # The stored-K product kernel (>= 80% of 4.27 TB/s at n = 36k, t = 11) and the dense backward in one call of
      # at most PERF_BUDGET seconds (default 345): build for sm_90 (ptxas lines of the kernels echoed), the
      # stored-product layouts at n = 36k, the CUDA tests of these kernels, bench_ops at the target shapes with the
      # backward op alone, Nsight Compute on one backward call (n = 16384, d = 8), the stored product at 13.5k, K @ V fwd+bwd at 36k, Nsight
      # Compute on one stored product, then a summary table. Steps run most valuable first, each cut to what is left of the budget. Files in $OUT:
      # perf_{build,tests,bench,ncu}.log and perf_results.tar.gz (the benchmarks' md/json).
      budget_start ${PERF_BUDGET:-345}
      export TORCH_CUDA_ARCH_LIST=9.0
      res="$OUT/perf_results"; mkdir -p "$res"
      brun 240 "$OUT/perf_build.log" python -m gpfast.build --verbose || { tail -40 "$OUT/perf_build.log"; exit 1; }
      echo "build done at $(( SECONDS - B_T0 )) s; ptxas (registers, spills) of the new kernels:"
      grep -A3 -E "Compiling entry function '.*(dense_matmul_kernelIfLi12|bwd_rows_kernelIfLi8ELi2ELi0E)" \
        "$OUT/perf_build.log" | grep -oE "Compiling entry function '[^']*'|[0-9]+ bytes spill stores|Used [0-9]+ registers" \
        | paste -d' ' - - - | sed -e 's/Compiling entry function //' | sort -u
      brun 75 "$OUT/perf_bench.log" python -m experiments.bench_stored_product --n 36000 --t 11 --reps 20 --out "$res"
      echo "stored product rc=$?"; grep -E "^\| |fastest" "$OUT/perf_bench.log" | tail -9
      brun 90 "$OUT/perf_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_dense_matmul.py \
        tests/test_cuda_kernels.py tests/test_ops.py \
        -k "dense_matmul or stored_product or covariance_backward or covariance_gradients"
      echo "tests rc=$?"; tail -4 "$OUT/perf_tests.log"
      brun 90 "$OUT/perf_bench.log" python -m experiments.bench_ops --quick --reps 5 --bwd-op \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8; echo "bench_ops rc=$?"
      cp experiments/results/bench_ops.md experiments/results/bench_ops.json "$res/" 2>/dev/null
      ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [ -n "$ncu_bin" ]; then
        ncu_args=(--profile-from-start off --clock-control none --set basic --section WarpStateStats --section Occupancy
                  --section ComputeWorkloadAnalysis -k "regex:bwd_rows_kernel|dense_matmul_kernel|dmm_sum_kernel")
        ncu_fp64=(--metrics sm__inst_executed_pipe_fp64.avg.pct_of_peak_sustained_active,sm__pipe_fp64_cycles_active.avg.pct_of_peak_sustained_active)
        # a metric this ncu does not know fails the run: then again with the sections only
        echo "#### ncu cov_bwd" >> "$OUT/perf_ncu.log"
        brun 45 "$OUT/perf_ncu.log" "$ncu_bin" "${ncu_args[@]}" "${ncu_fp64[@]}" python -m experiments.profile_ops --op cov_bwd \
          || brun 45 "$OUT/perf_ncu.log" "$ncu_bin" "${ncu_args[@]}" python -m experiments.profile_ops --op cov_bwd
        echo "ncu cov_bwd rc=$?"
      else
        echo "no ncu found" | tee -a "$OUT/perf_ncu.log"
      fi
      brun 30 "$OUT/perf_bench.log" python -m experiments.bench_stored_product --n 13500 --t 11 --reps 20 --out "$res" \
        --stem bench_stored_product_13500; echo "stored product 13.5k rc=$?"
      brun 45 "$OUT/perf_bench.log" python -m experiments.bench_matmul --cases 36000:11 --backward --reps 3 --no-gpytorch \
        --stem perf_matmul; echo "bench_matmul rc=$?"
      cp experiments/results/perf_matmul.md experiments/results/perf_matmul.json "$res/" 2>/dev/null
      if [ -n "$ncu_bin" ]; then
        echo "#### ncu dense_matmul" >> "$OUT/perf_ncu.log"
        brun 45 "$OUT/perf_ncu.log" "$ncu_bin" "${ncu_args[@]}" python -m experiments.profile_ops --op dense_matmul
        echo "ncu dense_matmul rc=$?"
      fi
      tar czf "$OUT/perf_results.tar.gz" -C "$OUT" perf_results && rm -rf "$res"
      timeout 30 python - "$OUT" "$(tail -1 "$OUT/perf_tests.log")" "$(( SECONDS - B_T0 ))" <<'PYEOF'
import io, json, re, sys, tarfile
from pathlib import Path
out, tests, took = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
files = {}
try:
    with tarfile.open(out / "perf_results.tar.gz") as tf:
        for m in tf.getmembers():
            if m.isfile() and m.name.endswith(".json"):
                files[Path(m.name).name] = json.load(io.TextIOWrapper(tf.extractfile(m)))["rows"]
except (OSError, ValueError, KeyError, tarfile.TarError) as exc:
    print("could not read the results:", exc)
def num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")
lines = []
for stem, label in (("bench_stored_product.json", "36k"), ("bench_stored_product_13500.json", "13.5k")):
    rows = files.get(stem, [])
    for r in rows:
        if r["layout"].startswith("kernel") or r["layout"] == "vtk":
            lines.append((f"stored K@V {label} t=11: {r['layout']}, ms (share of 4.27 TB/s)",
                          f"{num(r['ms']):.3f} ({100 * num(r['share_of_4.27TBps']):.0f}%)",
                          ">= 80%" if label == "36k" and r["layout"] == "kernel" else "-"))
    k = [r for r in rows if r["layout"] == "kernel"]
    if k:
        lines.append((f"stored K@V {label}: kernel rel. err / repeatable", f"{k[0]['rel_err']:.1e} / {k[0]['bitwise_repeatable']}", "-"))
ops_rows = {r["shape"]: r for r in files.get("bench_ops.json", [])}
for shape, name in (("(1,16384,16384,8)", "d=8 n=16384"), ("(4,8192,8192,32)", "d=32"), ("(1,40000,40000,8)", "d=8 n=40000")):
    r = ops_rows.get(shape, {})
    lines.append((f"bwd op {name}, ms: all / (l, s)", f"{num(r.get('gpfast_bwd')):.3f} / {num(r.get('gpfast_bwd_theta')):.3f}", "-"))
    lines.append((f"fwd+bwd vs GPyTorch {name}, x faster",
                  f"{num(r.get('gpytorch_fwd_bwd')) / num(r.get('gpfast_fwd_bwd', float('nan'))):.2f}", ">= 3" if "32" in name else ">= 10"))
r = (files.get("perf_matmul.json") or [{}])[0]
lines.append(("K@V 36k t=11: fwd / fwd+bwd (l, s), ms",
              f"{num(r.get('gpfast_s')) * 1e3:.2f} / {num(r.get('gpfast_fwd_bwd_theta_s')) * 1e3:.2f}", "-"))
ncu = (out / "perf_ncu.log").read_text(errors="replace") if (out / "perf_ncu.log").exists() else ""
keys = ("Duration", "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy", "Compute (SM) Throughput",
        "DRAM Throughput", "Memory Throughput", "Issue Slots Busy", "Warp Cycles Per Issued Instruction",
        "sm__inst_executed_pipe_fp64", "sm__pipe_fp64_cycles_active")
print(f"\nperf stage summary ({took} s). tests: {tests.strip()}")
print(f"| {'what':52s} | {'measured':>22s} | target |")
for name, val, target in lines:
    print(f"| {name:52s} | {val:>22s} | {target} |")
print("\nncu (per profiled kernel, in order: cov_bwd pass 1, pass 2; dense_matmul, its sum):")
for line in ncu.splitlines():
    s = line.strip()
    if s.startswith("####") or re.search(r"(bwd_rows_kernel|dense_matmul_kernel|dmm_sum_kernel).*Context", s) or \
       any(s.startswith(k) for k in keys) or "ERR_" in s or "==ERROR==" in s:
        print("  " + s[:150])
PYEOF
      ;;
    verify)
      # Everything a change of kernels and predictions must pass, in one call of at most VERIFY_BUDGET seconds
      # (default 560): build for sm_90, every CUDA test, compute-sanitizer memcheck and racecheck over every kernel
      # (experiments/sanitize_ops.py, 120 s each so that racecheck finishes), the CG-path prediction against the
      # float64 Cholesky at n = 100k (experiments/cg_prediction.py), bench_ops at the target shapes. Files in $OUT:
      # verify_*.log and verify_results.tar.gz (unpack into experiments/results).
      budget_start ${VERIFY_BUDGET:-560}
      export TORCH_CUDA_ARCH_LIST=9.0
      res="$OUT/verify_results"; mkdir -p "$res"
      brun 240 "$OUT/verify_build.log" python -m gpfast.build --verbose || { tail -40 "$OUT/verify_build.log"; exit 1; }
      echo "build done at $(( SECONDS - B_T0 )) s"
      brun 150 "$OUT/verify_tests.log" python -m pytest tests -q -m cuda -p no:cacheprovider; echo "tests rc=$?"
      tail -6 "$OUT/verify_tests.log"
      brun 110 "$OUT/verify_cgpred.log" python -m experiments.cg_prediction --agree 100000 --points 400 --out "$res"
      echo "cg_prediction rc=$?"; grep -E "^\| " "$OUT/verify_cgpred.log" | tail -5
      for tool in memcheck racecheck; do
        brun 120 "$OUT/verify_sanitize.log" compute-sanitizer --tool $tool --error-exitcode 3 python -m experiments.sanitize_ops
        echo "$tool rc=$?"
      done
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all kernels ran" "$OUT/verify_sanitize.log"
      brun 80 "$OUT/verify_bench.log" python -m experiments.bench_ops --quick --reps 5 \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8; echo "bench_ops rc=$?"
      cp experiments/results/bench_ops.md experiments/results/bench_ops.json "$res/" 2>/dev/null
      grep -E "^\| " "$OUT/verify_bench.log" | tail -5
      tar czf "$OUT/verify_results.tar.gz" -C "$OUT" verify_results && rm -rf "$res"
      echo "verify: $(( SECONDS - B_T0 )) s" ;;
    accuracy)
      # The training engine's changes on the GPU, in one call of at most ACCURACY_BUDGET seconds (default 560): build,
      # the CUDA tests of the engine and of the CG posterior, the CG posterior against the float64 Cholesky at
      # n = 100k, rows c (the engine) and "exact" (the same 50 Adam steps with exact gradients) on pol, elevators,
      # bike and kin40k, then step_anatomy on the seven sets. Files in $OUT: accuracy_*.log and
      # accuracy_results.tar.gz (unpack into experiments/results).
      stage_begin accuracy ${ACCURACY_BUDGET:-560}
      brun 60 "$OUT/accuracy_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_train.py \
        tests/test_cg_posterior.py tests/test_dense_matmul.py; echo "tests rc=$?"; tail -3 "$OUT/accuracy_tests.log"
      brun 100 "$OUT/accuracy_cgpred.log" python -m experiments.cg_prediction --agree 100000 --points 400 --out "$res"
      echo "cg_prediction rc=$?"; grep -E "^\| " "$OUT/accuracy_cgpred.log" | tail -4
      brun 200 "$OUT/accuracy_uci.log" "${UCI[@]}" \
        --datasets pol elevators bike kin40k --rows gpfast exact \
        --stem uci_pol_elevators_bike_kin40k_c_exact --out "$res"; echo "uci rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k) " "$OUT/accuracy_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,20
      anatomy "$OUT/accuracy_anatomy.log" 120
      stage_end accuracy ;;
    engine)
      # The engine's CUDA graphs and its final re-solve, in one call of at most ENGINE_BUDGET seconds (default 570):
      # build, the CUDA tests of the graphs, the engine and the CG posterior, row c on the seven sets, step_anatomy
      # on the seven sets, then row "exact" on protein (about 4 s a step). Files in $OUT: engine_*.log and
      # engine_results.tar.gz (unpack into experiments/results).
      stage_begin engine ${ENGINE_BUDGET:-570}
      brun 90 "$OUT/engine_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_graphs.py \
        tests/test_train.py tests/test_cg_posterior.py; echo "tests rc=$?"; tail -3 "$OUT/engine_tests.log"
      brun 150 "$OUT/engine_uci.log" "${UCI[@]}" \
        --rows gpfast --stem uci_all_c --out "$res"; echo "uci rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$OUT/engine_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,23
      anatomy "$OUT/engine_anatomy.log" 130
      brun 260 "$OUT/engine_exact.log" "${UCI[@]}" \
        --datasets protein --rows exact --stem uci_protein_exact --out "$res"
      echo "exact protein rc=$?"; grep -E "^\| protein" "$OUT/engine_exact.log" | cut -d'|' -f2,5,7,9,12,13
      stage_end engine ;;
    tensor_cores)
      # The tensor-core kernels and the one-launch pivot blocks, in one call of at most TC_BUDGET seconds (default
      # 585): build, every CUDA test, row c on the seven sets (the engine with the tensor-core backward and the
      # pivot kernel), the bilinear backward's sweep, step_anatomy (3 steps a pass), then the K @ V / forward sweep.
      # Files in $OUT: tc_*.log and tc_results.tar.gz (unpack into experiments/results).
      stage_begin tc ${TC_BUDGET:-585}
      brun 130 "$OUT/tc_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests; echo "tests rc=$?"
      grep -E "^(FAILED|ERROR)" "$OUT/tc_tests.log" | head -30; tail -2 "$OUT/tc_tests.log"
      brun 120 "$OUT/tc_uci.log" "${UCI[@]}" \
        --rows gpfast --stem uci_all_c --out "$res"; echo "uci rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$OUT/tc_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,23
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/tc_uci.log")"
      # the two sweeps are the tensor-core branches' scripts (bwd, tcfwd): skipped where they are not merged
      if [ -f experiments/bench_bilinear.py ]; then
        brun 60 "$OUT/tc_bilinear.log" python -m experiments.bench_bilinear --reps 10; echo "bench_bilinear rc=$?"
        grep -E "^\| " "$OUT/tc_bilinear.log" | tail -22
      fi
      anatomy "$OUT/tc_anatomy.log" 90 --steps 3
      if [ -f experiments/bench_tensor_cores.py ]; then
        brun 100 "$OUT/tc_sweep.log" python -m experiments.bench_tensor_cores --first-only
        echo "bench_tensor_cores rc=$?"; grep -E "^\| " "$OUT/tc_sweep.log" | tail -30
      fi
      cp experiments/results/bench_bilinear.* experiments/results/bench_tensor_cores.* "$res"/ 2>/dev/null
      stage_end tc ;;
    backward_rank)
      # The tensor-core (l, s) backward (the default for float32 K @ V without point gradients) and the
      # preconditioner's maximum rank, in one call of at most BR_BUDGET seconds (default 570): build; the backward's
      # argument-error and layout tests on their own (a crash there must not take the other tests with it), then the
      # CUDA tests of the kernels, ops, pivots, graphs, engine and CG posterior; row c on the seven sets (warnings
      # counted); the bilinear backward's sweep; row c on kin40k and protein at max_preconditioner_rank 1600 and
      # 3200; the CG posterior's cost model parts at 1M. Files in $OUT: br_*.log and br_results.tar.gz.
      stage_begin br ${BR_BUDGET:-570} 240
      brun 40 "$OUT/br_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py \
        -k "kernel_errors or layouts_and_empty"; echo "backward error tests rc=$?"
      brun 150 "$OUT/br_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py \
        tests/test_ops.py tests/test_pivoted_cholesky.py tests/test_cuda_graphs.py tests/test_train.py \
        tests/test_cg_posterior.py; echo "tests rc=$?"
      grep -E "^(FAILED|ERROR)|Fatal|Segmentation" "$OUT/br_tests.log" | head -30; tail -2 "$OUT/br_tests.log"
      brun 120 "$OUT/br_uci.log" "${UCI[@]}" --rows gpfast --stem uci_all_c --out "$res"; echo "uci rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$OUT/br_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,23
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/br_uci.log")"
      brun 90 "$OUT/br_bilinear.log" python -m experiments.bench_bilinear --reps 10; echo "bench_bilinear rc=$?"
      grep -E "^\| " "$OUT/br_bilinear.log" | tail -9; cp experiments/results/bench_bilinear.* "$res"/ 2>/dev/null
      for rank in 1600 3200; do
        brun 60 "$OUT/br_rank.log" "${UCI[@]}" --rows gpfast --datasets kin40k protein \
          --cg max_preconditioner_rank=$rank --stem uci_kin40k_protein_c_rank$rank --out "$res"; echo "rank $rank rc=$?"
        grep -E "^\| (kin40k|protein)" "$res/uci_kin40k_protein_c_rank$rank.md" | cut -d'|' -f2,5,7,9,10,12,13,23
      done
      echo "ConvergenceWarnings (ranks): $(grep -c ConvergenceWarning "$OUT/br_rank.log")"
      brun 120 "$OUT/br_cg1m.log" python -m experiments.cg_prediction --pieces 1000000 --test 10000 --cg-iters 40 \
        --stem cg_prediction_pieces_1m --out "$res"; echo "cg_prediction pieces rc=$?"; tail -6 "$OUT/br_cg1m.log"
      stage_end br ;;
    batched_rank)
      # The vectorised optimiser of many independent GPs and the training preconditioner through L (default rank
      # limit 3200), in one call of at most BAR_BUDGET seconds (default 570): build; a backtrace of the tensor-core
      # backward's argument-error test (it crashed the interpreter), then every other CUDA test of the kernels, ops,
      # pivots, graphs, engine, CG posterior and several outputs; batched_gps on the GPU; row c on the seven sets
      # (warnings counted). Files in $OUT: bar_*.log and bar_results.tar.gz.
      stage_begin bar ${BAR_BUDGET:-570} 240
      if command -v gdb > /dev/null; then
        brun 60 "$OUT/bar_gdb.log" gdb -batch -ex run -ex bt --args python -m pytest -q -m cuda -p no:cacheprovider \
          tests/test_cuda_kernels.py -k kernel_errors; echo "gdb rc=$?"; grep -E "^#[0-9]+ " "$OUT/bar_gdb.log" | head -25
      else
        echo "no gdb"
      fi
      brun 170 "$OUT/bar_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py \
        tests/test_ops.py tests/test_pivoted_cholesky.py tests/test_cuda_graphs.py tests/test_train.py \
        tests/test_cg_posterior.py tests/test_multioutput.py tests/test_batched_lbfgs.py \
        --deselect tests/test_cuda_kernels.py::test_bilinear_backward_kernel_errors; echo "tests rc=$?"
      grep -E "^(FAILED|ERROR)|Fatal|Segmentation" "$OUT/bar_tests.log" | head -30; tail -2 "$OUT/bar_tests.log"
      brun 150 "$OUT/bar_batched.log" python -m experiments.batched_gps --device cuda; echo "batched rc=$?"
      grep -E "^\| " "$OUT/bar_batched.log" | tail -8; cp experiments/results/batched_gps_cuda.* "$res"/ 2>/dev/null
      brun 120 "$OUT/bar_uci.log" "${UCI[@]}" --rows gpfast --stem uci_all_c --out "$res"; echo "uci rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$OUT/bar_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,23
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/bar_uci.log")"
      stage_end bar ;;
    rank_compare)
      # The training preconditioner's rank limit, 3200 (the default) against 800, on the seven sets in one call of at
      # most RC_BUDGET seconds (default 570): build; each argument error of the tensor-core backward's private op in
      # a process of its own (one crashed the interpreter); the engine's CUDA tests; row c at both limits; then
      # compute-sanitizer memcheck over every kernel with what is left. Files: rc_*.log, rc_results.tar.gz.
      stage_begin rc ${RC_BUDGET:-570} 240
      brun 90 "$OUT/rc_cases.log" python -m experiments.kernel_error_cases; echo "cases rc=$?"; tail -6 "$OUT/rc_cases.log"
      brun 60 "$OUT/rc_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_train.py \
        tests/test_cuda_graphs.py tests/test_cg_posterior.py tests/test_pivoted_cholesky.py; echo "tests rc=$?"
      grep -E "^(FAILED|ERROR)" "$OUT/rc_tests.log" | head; tail -1 "$OUT/rc_tests.log"
      for rank in 3200 800; do
        brun 130 "$OUT/rc_uci.log" "${UCI[@]}" --rows gpfast --cg max_preconditioner_rank=$rank \
          --stem uci_all_c_rank$rank --out "$res"; echo "rank $rank rc=$?"
        grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_c_rank$rank.md" | cut -d'|' -f2,7,9,10,12,13,23,24
      done
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/rc_uci.log")"; grep -B1 ConvergenceWarning "$OUT/rc_uci.log" | cut -c1-300
      brun 200 "$OUT/rc_memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 python -m experiments.sanitize_ops
      echo "memcheck rc=$?"; tail -3 "$OUT/rc_memcheck.log"
      stage_end rc ;;
    fixes)
      # The private backward op's argument errors (each in a process of its own, then its test), every other CUDA
      # test, and the CG posterior's cost model parts at 1M, in one call of at most FIX_BUDGET seconds (default
      # 540). Files: fix_*.log and fix_results.tar.gz.
      stage_begin fix ${FIX_BUDGET:-540} 240
      brun 90 "$OUT/fix_cases.log" python -m experiments.kernel_error_cases; echo "cases rc=$?"; tail -6 "$OUT/fix_cases.log"
      brun 40 "$OUT/fix_errors.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py \
        -k kernel_errors; echo "errors test rc=$?"; tail -2 "$OUT/fix_errors.log"
      brun 170 "$OUT/fix_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests \
        --deselect tests/test_cuda_kernels.py::test_bilinear_backward_kernel_errors; echo "tests rc=$?"
      grep -E "^(FAILED|ERROR)|Fatal|Segmentation" "$OUT/fix_tests.log" | head -30; tail -2 "$OUT/fix_tests.log"
      brun 200 "$OUT/fix_cg1m.log" python -m experiments.cg_prediction --pieces 1000000 --test 10000 --cg-iters 40 \
        --stem cg_prediction_pieces_1m --out "$res"; echo "cg_prediction pieces rc=$?"; tail -8 "$OUT/fix_cg1m.log"
      stage_end fix ;;
    engine_check)
      # The shortest check of the engine's device code (for a nearly spent budget): build, the CUDA tests of the
      # pivot blocks, the CUDA graphs, the engine and the CG posterior, then row c on bike (whose last solve missed
      # its tolerance in the tensor_cores stage: does the fit still warn?). Files in $OUT: check_*.log and
      # check_results.tar.gz.
      stage_begin check ${CHECK_BUDGET:-300} 200
      brun 60 "$OUT/check_tests.log" python -m pytest -q -m cuda -p no:cacheprovider tests/test_pivoted_cholesky.py \
        tests/test_cuda_graphs.py tests/test_train.py tests/test_cg_posterior.py; echo "tests rc=$?"
      grep -E "^(FAILED|ERROR)" "$OUT/check_tests.log" | head; tail -1 "$OUT/check_tests.log"
      brun 40 "$OUT/check_uci.log" "${UCI[@]}" \
        --rows gpfast --datasets bike --stem uci_bike_c --out "$res"; echo "uci rc=$?"
      grep -E "^\| bike" "$OUT/check_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,23
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/check_uci.log")"
      stage_end check ;;
    accuracy_large)
      # Row "exact" (50 Adam steps with float64 Cholesky gradients, about 4.7 s a step) on keggdirected, then the CG
      # posterior's cost model parts at 1M points (each printed as it ends), in one call of at most ACCURACY_BUDGET
      # seconds (default 560). Row c of the large sets comes from the engine stages; keggundirected's exact row (about 10 s a step, 520 s) does not fit
      # in one call beside the build. Files: accuracy_large_*.log and accuracy_large_results.tar.gz.
      stage_begin accuracy_large ${ACCURACY_BUDGET:-560}
      brun 330 "$OUT/accuracy_large_uci.log" "${UCI[@]}" --datasets keggdirected --rows exact --stem uci_keggdirected_exact \
        --out "$res"; echo "uci keggdirected exact rc=$?"
      grep -E "^\| kegg" "$OUT/accuracy_large_uci.log" | cut -d'|' -f2,5,7,9,10,12,13,23
      brun 200 "$OUT/accuracy_large_cg1m.log" python -m experiments.cg_prediction --pieces 1000000 --test 10000 \
        --cg-iters 20 --stem cg_prediction_pieces_1m --out "$res"; echo "cg_prediction 1M rc=$?"
      tail -8 "$OUT/accuracy_large_cg1m.log"
      stage_end accuracy_large ;;
    final)
      # The last call of a round with little device time: build, every CUDA test, kin40k's rows c and exact, then the
      # CG posterior against the float64 Cholesky at n = CG_AGREE_N (default 30000). FINAL_BUDGET seconds (560).
      stage_begin final ${FINAL_BUDGET:-560}
      brun 90 "$OUT/final_tests.log" python -m pytest tests -q -m cuda -p no:cacheprovider; echo "tests rc=$?"
      tail -3 "$OUT/final_tests.log"
      brun 240 "$OUT/final_uci.log" "${UCI[@]}" \
        --datasets kin40k --rows gpfast exact --stem uci_kin40k_c_exact --out "$res"
      echo "uci kin40k rc=$?"; grep -E "^   (gpfast|exact)" "$OUT/final_uci.log"
      brun 150 "$OUT/final_cgpred.log" python -m experiments.cg_prediction --agree ${CG_AGREE_N:-30000} --points 300 \
        --out "$res"; echo "cg_prediction rc=$?"; grep -E "^n=|^\| " "$OUT/final_cgpred.log" | cut -c1-250 | tail -8
      stage_end final ;;
    session3)
      # The exact path's blocked inverse and the engine's check placement, in one call of at most S3_BUDGET seconds
      # (default 585): build; every CUDA test; bench_inverse (torch's inverse against the blocked one at 20k and
      # 40k); row c on the seven sets; row exact on keggdirected; then 8 stored products at 20k in a loop against one
      # torch.bmm (independent outputs). Files: s3_*.log and s3_results.tar.gz.
      stage_begin s3 ${S3_BUDGET:-585} 240
      cuda_tests "$OUT/s3_tests.log" 100 tests
      brun 90 "$OUT/s3_inverse.log" python -m experiments.bench_inverse --sizes 20000 40000 --blocks 1024 2048 4096 \
        --out "$res"; echo "inverse rc=$?"; grep -E "^\| [0-9]" "$OUT/s3_inverse.log"
      row_c "$OUT/s3_uci_c.log" 150
      exact_row "$OUT/s3_exact.log" keggdirected 300
      brun 40 "$OUT/s3_batch.log" python -m experiments.bench_stored_product --n 20000 --t 11 --batch 8 --reps 10 \
        --stem bench_stored_product_batch8 --out "$res"; echo "batch rc=$?"; grep -E "^\| (loop|torch)" "$OUT/s3_batch.log"
      stage_end s3 ;;
    session3c)
      # step_anatomy on the seven sets, then compute-sanitizer memcheck and racecheck over every kernel, in one call of
      # at most S3C_BUDGET seconds (default 585). Files: s3c_*.log and s3c_results.tar.gz.
      stage_begin s3c ${S3C_BUDGET:-585} 240
      anatomy "$OUT/s3c_anatomy.log" 130
      for tool in memcheck racecheck; do
        brun 200 "$OUT/s3c_$tool.log" compute-sanitizer --tool $tool --error-exitcode 3 python -m experiments.sanitize_ops
        echo "$tool rc=$?"; tail -3 "$OUT/s3c_$tool.log"
      done
      stage_end s3c ;;
    session3d)
      # The engine's check placement from its own reads and the at-risk test on the last step, and where an exact
      # step's time goes, in one call of at most S3D_BUDGET seconds (default 585): build; the CUDA tests of the engine,
      # the CG posterior and the exact routines; exact_step at keggdirected's size; row c on the seven sets.
      # Files: s3d_*.log and s3d_results.tar.gz.
      stage_begin s3d ${S3D_BUDGET:-585} 240
      cuda_tests "$OUT/s3d_tests.log" 80 tests/test_train.py \
        tests/test_cuda_graphs.py tests/test_cg_posterior.py tests/test_models.py
      brun 100 "$OUT/s3d_exact_step.log" python -m experiments.exact_step --n 44000 --d 20 --reps 2 --out "$res"
      echo "exact_step rc=$?"; grep -E "^\| [0-9]" "$OUT/s3d_exact_step.log"
      row_c "$OUT/s3d_uci_c.log" 150
      stage_end s3d ;;
    session3e)
      # Row exact on keggdirected, then the CG posterior's cost parts at 1M (each printed as it ends), in one call of
      # at most S3E_BUDGET seconds (default 585). Files: s3e_*.log and s3e_results.tar.gz.
      stage_begin s3e ${S3E_BUDGET:-585} 240
      exact_row "$OUT/s3e_exact.log" keggdirected 340
      brun 300 "$OUT/s3e_cg1m.log" python -m experiments.cg_prediction --pieces 1000000 --test 10000 --cg-iters 20 \
        --stem cg_prediction_pieces_1m --out "$res"; echo "cg_prediction pieces rc=$?"; tail -8 "$OUT/s3e_cg1m.log"
      stage_end s3e ;;
    session3f)
      # The last minutes of a session: build; the exact UCI row's first evaluations on keggdirected (time, jitter,
      # runs: experiments.exact_row_probe); the CG posterior's cost parts at 200k (its set-up at 1M did not end in
      # 235 s). Files: s3f_*.log and s3f_results.tar.gz.
      stage_begin s3f ${S3F_BUDGET:-250} 120
      brun 70 "$OUT/s3f_probe.log" python -m experiments.exact_row_probe --dataset keggdirected --iters 3 \
        --data-dir .data/uci; echo "probe rc=$?"; tail -6 "$OUT/s3f_probe.log"
      brun 90 "$OUT/s3f_cg200k.log" python -m experiments.cg_prediction --pieces 200000 --test 1000 --cg-iters 10 \
        --stem cg_prediction_pieces_200k --out "$res"; echo "cg_prediction pieces rc=$?"; tail -8 "$OUT/s3f_cg200k.log"
      stage_end s3f ;;
    exact_kegg)
      # Row exact (50 Adam steps with float64 Cholesky gradients, one run: no low-noise second run above 20,000
      # points) on the sets in EXACT_SETS (default keggdirected, about 51 x 3.2 s; keggundirected about 51 x 7 s:
      # give it a call of its own), in one call of at most EK_BUDGET seconds (default 585). Merge the rows into
      # experiments/results/uci_engine_vs_exact with `python -m experiments.uci_table --merge`. Files: ek_*.log and
      # ek_results.tar.gz.
      stage_begin ek ${EK_BUDGET:-585} 240
      for set in ${EXACT_SETS:-keggdirected}; do exact_row "$OUT/ek_$set.log" $set 560; done
      stage_end ek ;;
    session4a)
      # Build; row exact on keggdirected; row c on the seven sets (checks placed from the solves' reads, at most two
      # reads a solve); the CG posterior's cost parts at 1M with its set-up timed part by part; in one call of at
      # most S4A_BUDGET seconds (default 585). Files: s4a_*.log and s4a_results.tar.gz.
      stage_begin s4a ${S4A_BUDGET:-585} 240
      exact_row "$OUT/s4a_exact.log" keggdirected 215
      row_c "$OUT/s4a_uci_c.log" 150
      cg1m_parts "$OUT/s4a_cg1m.log" 300
      stage_end s4a ;;
    session4b)
      # Row exact on the sets in EXACT_SETS (default keggundirected, about 51 x 7 s), then step_anatomy on the seven
      # sets, in one call of at most S4B_BUDGET seconds (default 585). Files: s4b_*.log and s4b_results.tar.gz.
      stage_begin s4b ${S4B_BUDGET:-585} 240
      for set in ${EXACT_SETS:-keggundirected}; do exact_row "$OUT/s4b_$set.log" $set 420; done
      anatomy "$OUT/s4b_anatomy.log" 130
      stage_end s4b ;;
    session4c)
      # Why the CG posterior's set-up does not end at 1M: the pivoted Cholesky's operations timed one by one
      # (experiments.pivot_probe) at 200k, then at 1M each in its own process under a timeout (a Python stack every
      # 15 s names the call a cut one was in), then the CG posterior's cost parts at 1M; in one call of at most
      # S4C_BUDGET seconds (default 520). Files: s4c_*.log and s4c_results.tar.gz.
      stage_begin s4c ${S4C_BUDGET:-520} 240
      brun 40 "$OUT/s4c_probe200k.log" python -m experiments.pivot_probe --n 200000 --op all; tail -18 "$OUT/s4c_probe200k.log"
      for op in topk rows gemm pivot trsm trsm_inverse assign chol16 chol128 chol1024 fold; do
        CUDA_LAUNCH_BLOCKING=1 brun 45 "$OUT/s4c_probe1m.log" python -m experiments.pivot_probe --n 1000000 --op $op \
          --watchdog 15; echo "probe 1M $op rc=$?"; grep -E "^n=" "$OUT/s4c_probe1m.log" | tail -3
      done
      cg1m_parts "$OUT/s4c_cg1m.log" 300
      stage_end s4c ;;
    session5)
      # The pivoted Cholesky by products with the pivots' inverse: build; the CUDA tests of the pivoted Cholesky,
      # engine, graphs and CG posterior; the CG posterior's cost parts at 1M (set-up part by part, products, 20
      # iterations of the mean-weight solve, the bounds that need no solve for 10,000 test points); row c on the
      # seven sets; in one call of at most S5_BUDGET seconds (default 585). Files: s5_*.log and s5_results.tar.gz.
      stage_begin s5 ${S5_BUDGET:-585} 240
      cuda_tests "$OUT/s5_tests.log" 90 tests/test_pivoted_cholesky.py \
        tests/test_train.py tests/test_cuda_graphs.py tests/test_cg_posterior.py
      cg1m_parts "$OUT/s5_cg1m.log" 240
      row_c "$OUT/s5_uci_c.log" 150
      stage_end s5 ;;
    session6)
      # The preconditioner's rebuilds at an unchanged rank as CUDA-graph replays: build; the CUDA tests of the graphs,
      # the pivoted Cholesky and the engine; step_anatomy on the seven sets (with launches by part and by operator);
      # row c on the seven sets; compute-sanitizer memcheck and racecheck over every kernel with what is left; in one
      # call of at most S6_BUDGET seconds (default 585). Files: s6_*.log and s6_results.tar.gz.
      stage_begin s6 ${S6_BUDGET:-585} 240
      cuda_tests "$OUT/s6_tests.log" 90 tests/test_cuda_graphs.py \
        tests/test_pivoted_cholesky.py tests/test_train.py
      anatomy "$OUT/s6_anatomy.log" 130
      row_c "$OUT/s6_uci_c.log" 150
      for tool in memcheck racecheck; do
        brun 200 "$OUT/s6_$tool.log" compute-sanitizer --tool $tool --error-exitcode 3 python -m experiments.sanitize_ops
        echo "$tool rc=$?"; tail -3 "$OUT/s6_$tool.log"
      done
      stage_end s6 ;;
    session6b)
      # The preconditioner part by part (experiments.bench_preconditioner: op-by-op build, capture, replay, C^-1 two
      # ways, P^-1 V) on keggdirected at ranks 100, 400 and 3200 and on pol at 3200, 16 and 32 pivots a block; then
      # every CUDA test; in one call of at most S6B_BUDGET seconds (default 585). Files: s6b_*.log, s6b_results.tar.gz.
      stage_begin s6b ${S6B_BUDGET:-585} 240
      brun 100 "$OUT/s6b_precond.log" python -m experiments.bench_preconditioner --dataset keggdirected \
        --data-dir .data/uci --out "$res"; echo "bench_preconditioner rc=$?"; grep -E "^\| " "$OUT/s6b_precond.log"
      brun 60 "$OUT/s6b_precond_pol.log" python -m experiments.bench_preconditioner --dataset pol --data-dir .data/uci \
        --ranks 3200 --stem bench_preconditioner_pol --out "$res"; echo "bench_preconditioner pol rc=$?"
      grep -E "^\| " "$OUT/s6b_precond_pol.log"
      cuda_tests "$OUT/s6b_tests.log" 240 tests
      stage_end s6b ;;
    session6c)
      # The preconditioner's scales taken only once they move (rescale_change) and C^-1 by a triangular solve, with
      # the graphed rebuilds: build; the CUDA tests of the graphs, pivoted Cholesky, engine and checkpoints; row c on
      # the seven sets; step_anatomy; row c on keggdirected twice more (is a fit the same run to run?);
      # bench_preconditioner on keggdirected; in one call of at most S6C_BUDGET seconds (default 585). Files:
      # s6c_*.log and s6c_results.tar.gz.
      stage_begin s6c ${S6C_BUDGET:-585} 240
      cuda_tests "$OUT/s6c_tests.log" 90 tests/test_cuda_graphs.py \
        tests/test_pivoted_cholesky.py tests/test_train.py tests/test_checkpoint.py
      row_c "$OUT/s6c_uci_c.log" 150
      anatomy "$OUT/s6c_anatomy.log" 130
      for rep in 1 2; do
        brun 40 "$OUT/s6c_kegg_rep.log" "${UCI[@]}" --datasets keggdirected --rows gpfast --stem uci_keggdirected_c_$rep \
          --out "$res"; echo "keggdirected rep $rep rc=$?"
      done
      grep -E "^\| kegg" "$res"/uci_keggdirected_c_*.md | cut -d'|' -f2,7,9,10,12,13
      brun 80 "$OUT/s6c_precond.log" python -m experiments.bench_preconditioner --dataset keggdirected --kernels 12 \
        --data-dir .data/uci --out "$res"; echo "bench_preconditioner rc=$?"; grep -E "^\| " "$OUT/s6c_precond.log"
      stage_end s6c ;;
    session6d)
      # The pivoted Cholesky at 32 pivots a block: build; the CUDA tests of the pivoted Cholesky and the graphs; row c
      # on the seven sets; step_anatomy on the sets in ANATOMY_SETS (default the four smaller) with what is left; in
      # one call of at most S6D_BUDGET seconds (default 330, the end of a session's device time). Files: s6d_*.log
      # and s6d_results.tar.gz.
      stage_begin s6d ${S6D_BUDGET:-330} 240
      cuda_tests "$OUT/s6d_tests.log" 40 tests/test_pivoted_cholesky.py \
        tests/test_cuda_graphs.py
      row_c "$OUT/s6d_uci_c.log" 150
      anatomy "$OUT/s6d_anatomy.log" 120 --datasets ${ANATOMY_SETS:-pol elevators bike kin40k}
      stage_end s6d ;;
    session7)
      # 32 pivots a block against 16: build; the CUDA tests of the pivoted Cholesky, graphs, engine and checkpoints;
      # row c on the seven sets at the defaults and at CGSettings(pivot_block=32) (stem uci_all_c_b32: merge it
      # into uci_engine_vs_exact if it stays within the bounds); step_anatomy on the seven sets; in one call of at
      # most S7_BUDGET seconds (default 585). Files: s7_*.log and s7_results.tar.gz.
      stage_begin s7 ${S7_BUDGET:-585} 240
      cuda_tests "$OUT/s7_tests.log" 60 tests/test_pivoted_cholesky.py \
        tests/test_cuda_graphs.py tests/test_train.py tests/test_checkpoint.py
      row_c "$OUT/s7_uci_c.log" 150
      brun 150 "$OUT/s7_uci_c_b32.log" "${UCI[@]}" --rows gpfast --cg pivot_block=32 --stem uci_all_c_b32 --out "$res"
      echo "uci c b32 rc=$?"; grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_c_b32.md" \
        | cut -d'|' -f2,7,9,10,12,13,23,24; echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/s7_uci_c_b32.log")"
      anatomy "$OUT/s7_anatomy.log" 170
      stage_end s7 ;;
    session8c)
      # K @ V on tensor cores (float32's default from 10^10 pairs), third form (64-column tiles; three ways to split
      # P): build (ptxas report); every CUDA test; memcheck and racecheck over the K @ V kernels; the kernel sweep at
      # 1M, 200k and 36k; the SASS instruction mix of the default kernel; the 1M engine step; in one call of at most
      # S8C_BUDGET seconds (default 585). Files: s8c_*.log, s8c_results.tar.gz.
      stage_begin s8c ${S8C_BUDGET:-585} 240
      echo "ptxas of kv_tc_kernel:"
      grep -A2 "kv_tc_kernel" "$OUT/s8c_build.log" | grep -E "registers|spill" | sort | uniq -c | head -24
      cuda_tests "$OUT/s8c_tests.log" 150 tests
      sanitizers "$OUT/s8c_sanitize.log" 60 --only matmul
      brun 100 "$OUT/s8c_kv.log" python -m experiments.bench_matmul --cases 1000000:16 200000:16 36000:11 \
        --kernels cuda_cores tc tc_occ3 tc_t32 tc_vsplit tc_isplit --reps 3 --stem bench_matmul
      echo "bench_matmul kernels rc=$?"; cp experiments/results/bench_matmul_kernels.* "$res/" 2>/dev/null
      grep -E "^\| [0-9]" "$res/bench_matmul_kernels.md"
      so=$(ls /tmp/gpb/*/*.so 2>/dev/null | head -1)
      [ -n "$so" ] && cuobjdump -sass "$so" > /tmp/s8c_sass.txt 2>&1
      timeout 60 python - /tmp/s8c_sass.txt <<'PYEOF' | tee "$OUT/s8c_sass_mix.txt"
import collections, re, sys
text = open(sys.argv[1]).read()
# static instruction counts, one function per "Function :" header; the default kernel at d <= 8, t <= 16 has template arguments 1, 2, 1, 8, 64
for part in text.split("Function : ")[1:]:
    name = part.split("\n", 1)[0]
    if "kv_tc_kernelILi1ELi2ELi1ELi8ELi64E" not in name:
        continue
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", part))
    print(name[:90], sum(ops.values()), "instructions")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common(24)))
PYEOF
      brun 200 "$OUT/s8c_engine1m.log" python -m experiments.engine_step --n 1000000 --d 8 --steps 1 --out "$res"
      echo "engine1m rc=$?"; tail -4 "$OUT/s8c_engine1m.log"
      stage_end s8c ;;
    session9)
      # The float32 covariance backward (bwd_rows_f32_kernel, float32's default): build (ptxas report); its CUDA
      # tests; bench_ops at the target shapes with both row passes timed and their errors against float64; memcheck
      # and racecheck over the backward's row passes; every CUDA test; in one call of at most S9_BUDGET seconds
      # (default 585). Files: s9_*.log, s9_results.tar.gz.
      stage_begin s9 ${S9_BUDGET:-585} 240
      echo "ptxas of bwd_rows_f32_kernel:"
      grep -A2 "bwd_rows_f32_kernel" "$OUT/s9_build.log" | grep -E "registers|spill" | sort | uniq -c | head -24
      cuda_tests "$OUT/s9_tests_bwd.log" 90 tests/test_cuda_kernels.py -k "backward or rows32"
      brun 130 "$OUT/s9_bench.log" python -m experiments.bench_ops --quick --reps 5 --bwd-op \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      sanitizers "$OUT/s9_sanitize.log" 50 --only backward
      cuda_tests "$OUT/s9_tests.log" 170 tests
      stage_end s9 ;;
    session9b)
      # The one-pass float32 covariance backward (bwd_onepass_f32_kernel, float32's default for d <= 16): build
      # (ptxas report); the backward's CUDA tests; bench_ops at the target shapes with every backward kernel timed and
      # its error; Nsight Compute over the one-pass kernel and the float32 row passes at n = 16384, d = 8; memcheck and
      # racecheck over the backward's kernels; every CUDA test; in one call of at most S9B_BUDGET seconds (default
      # 585). Files: s9b_*.log, s9b_results.tar.gz.
      stage_begin s9b ${S9B_BUDGET:-585} 240
      echo "ptxas of bwd_onepass_f32_kernel:"
      grep -A2 "bwd_onepass_f32_kernel" "$OUT/s9b_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      cuda_tests "$OUT/s9b_tests_bwd.log" 100 tests/test_cuda_kernels.py tests/test_ops.py \
        -k "backward or grad or rows32 or onepass or float32"
      brun 130 "$OUT/s9b_bench.log" python -m experiments.bench_ops --quick --reps 5 --bwd-op \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for k in onepass32 rows32; do
        echo "#### ncu $k" >> "$OUT/s9b_ncu.log"
        brun 40 "$OUT/s9b_ncu.log" "$ncu_bin" --profile-from-start off --clock-control none --set basic \
          --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \
          python -m experiments.profile_ops --op cov_bwd --bwd-kernel $k; echo "ncu $k rc=$?"
      done
      grep -E "####|bwd_|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Compute \(SM\) Thr|Memory Thr|Stall|Executed Ipc A" "$OUT/s9b_ncu.log" | head -40
      sanitizers "$OUT/s9b_sanitize.log" 45 --only backward
      cuda_tests "$OUT/s9b_tests.log" 170 tests
      stage_end s9b ;;
    session9c)
      # The float32 backward's accuracy on many draws and the one-pass kernel with registers capped: build; the
      # backward's CUDA tests; backward_f32_probe (every float32 kernel against the accuracy rule on 300 draws a d,
      # and the float32 row passes against their CPU emulation); bench_ops at the target shapes; in one call of at
      # most S9C_BUDGET seconds (default 400). Files: s9c_*.log, s9c_results.tar.gz.
      stage_begin s9c ${S9C_BUDGET:-400} 240
      grep -A2 "bwd_onepass_f32_kernel" "$OUT/s9c_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      brun 120 "$OUT/s9c_probe.log" python -m experiments.backward_f32_probe --draws 300
      echo "probe rc=$?"; cp experiments/results/backward_f32_probe.* "$res/" 2>/dev/null
      grep -E "^\| " "$res/backward_f32_probe.md"
      cuda_tests "$OUT/s9c_tests_bwd.log" 100 tests/test_cuda_kernels.py tests/test_ops.py \
        -k "backward or grad or rows32 or onepass or float32"
      brun 130 "$OUT/s9c_bench.log" python -m experiments.bench_ops --quick --reps 5 --bwd-op \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      stage_end s9c ;;
    session9d)
      # The float32 backward as it lands (the one-pass kernel, float32's default for d <= 16; the float32 row passes
      # deleted): build; the backward's CUDA tests; backward_f32_probe; memcheck and racecheck over the backward's
      # kernels; bench_ops at the target shapes; every CUDA test; in one call of at most S9D_BUDGET seconds (default
      # 540). Files: s9d_*.log, s9d_results.tar.gz.
      stage_begin s9d ${S9D_BUDGET:-540} 240
      grep -A2 "bwd_onepass_f32_kernel" "$OUT/s9d_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      cuda_tests "$OUT/s9d_tests_bwd.log" 90 tests/test_cuda_kernels.py tests/test_ops.py \
        -k "backward or grad or onepass or float32"
      brun 90 "$OUT/s9d_probe.log" python -m experiments.backward_f32_probe --draws 300
      echo "probe rc=$?"; cp experiments/results/backward_f32_probe.* "$res/" 2>/dev/null
      grep -E "^\| " "$res/backward_f32_probe.md"
      sanitizers "$OUT/s9d_sanitize.log" 45 --only backward
      brun 110 "$OUT/s9d_bench.log" python -m experiments.bench_ops --quick --reps 5 --bwd-op \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,40000,40000,8
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      cuda_tests "$OUT/s9d_tests.log" 120 tests
      stage_end s9d ;;
    session10)
      # The tensor-core covariance forward (float32, 8 < d <= 32, the default there) and rebuilds that wait for their
      # cost (CGSettings.rebuild_cost_share), in value order: build (ptxas report); the forward's CUDA tests; bench_ops
      # at the target shapes and the engine sets' d (every forward kernel timed, with its error); row c on the seven
      # sets at the defaults, then at rebuild_cost_share=0 (every rebuild the lengthscale and age rules ask for);
      # memcheck and racecheck over the forward's kernels; the engine's CUDA tests; in one call of at most S10_BUDGET
      # seconds (default 575). Files: s10_*.log, s10_results.tar.gz.
      stage_begin s10 ${S10_BUDGET:-575} 240
      grep -A2 "cov_fwd_tc_kernel" "$OUT/s10_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      cuda_tests "$OUT/s10_tests_fwd.log" 60 tests/test_cuda_kernels.py -k "forward or diagonal or covariance_kernel"
      brun 100 "$OUT/s10_bench.log" python -m experiments.bench_ops --quick --reps 5 \
        --shapes 1,16384,16384,8 4,8192,8192,32 1,16384,16384,16 1,13500,13500,26 1,43945,43945,20
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      row_c "$OUT/s10_uci_c.log" 150
      brun 150 "$OUT/s10_uci_c_share0.log" "${UCI[@]}" --rows gpfast --cg rebuild_cost_share=0 --stem uci_c_share0 \
        --out "$res"
      echo "uci c share0 rc=$?"; grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_c_share0.md" \
        | cut -d'|' -f2,7,9,10,12,13,23,24; echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/s10_uci_c_share0.log")"
      sanitizers "$OUT/s10_sanitize.log" 40 --only forward
      cuda_tests "$OUT/s10_tests_engine.log" 60 tests/test_train.py tests/test_cuda_graphs.py
      stage_end s10 ;;
    session10b)
      # The tensor-core forward with columns in registers and rows streamed: build (ptxas report); the forward's CUDA
      # tests; bench_ops at the target shapes and the engine sets' sizes (keggdirected's unpadded and with rows padded
      # to 16 bytes, as the engine stores K); row c on the seven sets; memcheck and racecheck over the forward's
      # kernels; every CUDA test; in one call of at most S10B_BUDGET seconds (default 560). Files: s10b_*.log,
      # s10b_results.tar.gz.
      stage_begin s10b ${S10B_BUDGET:-560} 240
      grep -A2 "cov_fwd_tc_kernel" "$OUT/s10b_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      cuda_tests "$OUT/s10b_tests_fwd.log" 60 tests/test_cuda_kernels.py -k "forward or diagonal or covariance_kernel"
      brun 110 "$OUT/s10b_bench.log" python -m experiments.bench_ops --quick --reps 5 \
        --shapes 4,8192,8192,32 1,16384,16384,16 1,13500,13500,26 1,43945,43945,20 1,43945,43948,20 1,57248,57248,27
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      row_c "$OUT/s10b_uci_c.log" 150
      sanitizers "$OUT/s10b_sanitize.log" 40 --only forward
      cuda_tests "$OUT/s10b_tests.log" 150 tests
      stage_end s10b ;;
    session10c)
      # What lands (the tensor-core forward as float32's default for 16 < d <= 32; numbers in C++ error messages as
      # text): build; every CUDA test (the C++ checks' subprocess tests among them); row c on the seven sets;
      # step_anatomy on keggundirected and pol (their steps were slower than at 81b240e in calls 1 and 2); in one
      # call of at most S10C_BUDGET seconds (default 470). Files: s10c_*.log, s10c_results.tar.gz.
      stage_begin s10c ${S10C_BUDGET:-470} 240
      cuda_tests "$OUT/s10c_tests.log" 150 -rX tests
      row_c "$OUT/s10c_uci_c.log" 130
      anatomy "$OUT/s10c_anatomy.log" 120 --datasets keggundirected pol
      stage_end s10c ;;
    session11a)
      # Where the steps of the sets with d > 16 go (slower since the tensor-core forward became their default):
      # build; step_anatomy on keggundirected, keggdirected, pol and elevators with the kernels that take the most
      # device time a step, at the default forward and with the norm expansion forced; bench_ops on the pivoted
      # Cholesky's row blocks (32 candidates against every point) and two square shapes; Nsight Compute of the
      # tensor-core forward at (4, 8192, 8192, 32); the compiled library packed as OUTDIR/gpb.tgz; in one call of at
      # most S11A_BUDGET seconds (default 460). Files: s11a_*.log, s11a_results.tar.gz, gpb.tgz.
      stage_begin s11a ${S11A_BUDGET:-460} 240
      pack_build
      for fwd in default expand; do
        extra=(); [ "$fwd" = default ] || extra=(--forward "$fwd")
        ANATOMY_STEM="step_anatomy_$fwd" anatomy "$OUT/s11a_anatomy.log" 80 \
          --datasets keggundirected keggdirected pol elevators "${extra[@]}"
      done
      brun 90 "$OUT/s11a_bench.log" python -m experiments.bench_ops --quick --reps 10 \
        --shapes 1,32,57248,27 1,32,43945,20 1,32,13500,26 1,32,14940,18 4,8192,8192,32 1,43945,43948,20
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops.md"
      ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for k in tc expand; do
        echo "#### ncu $k" >> "$OUT/s11a_ncu.log"
        brun 50 "$OUT/s11a_ncu.log" "$ncu_bin" --profile-from-start off --clock-control none --set detailed \
          --section WarpStateStats --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
          python -m experiments.profile_ops --op cov_fwd --fwd-kernel $k; echo "ncu $k rc=$?"
      done
      grep -E "####|cov_|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Compute \(SM\) Thr|Memory Thr|DRAM Thr|L2 Cache Thr|Stall|Executed Ipc A|Warp Cycles Per Issued|L1/TEX Hit|Mem Busy|Max Bandwidth" \
        "$OUT/s11a_ncu.log" | head -70
      stage_end s11a ;;
    session11b)
      # What lands (the norm expansion float32's default forward for 8 < d <= 32 again; the tensor-core kernel by
      # name only): build; every CUDA test; row c on the seven sets; bench_ops with clustered points (duplicates,
      # as in the kegg sets) at the engine sets' sizes and the d = 32 target shape, every forward kernel;
      # step_anatomy on keggundirected and pol; in one call of at most S11B_BUDGET seconds (default 480). Files:
      # s11b_*.log, s11b_results.tar.gz.
      stage_begin s11b ${S11B_BUDGET:-480} 240
      cuda_tests "$OUT/s11b_tests.log" 150 -rX tests
      row_c "$OUT/s11b_uci_c.log" 130
      brun 70 "$OUT/s11b_bench.log" python -m experiments.bench_ops --quick --reps 5 --points clustered \
        --stem bench_ops_clustered --shapes 4,8192,8192,32 1,13500,13500,26 1,43945,43948,20 1,57248,57248,27
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops_clustered.* "$res/" 2>/dev/null
      grep -E "^\| \(|^- " "$res/bench_ops_clustered.md"
      anatomy "$OUT/s11b_anatomy.log" 60 --datasets keggundirected pol
      stage_end s11b ;;
    session11c)
      # The steps after the preconditioner rank has settled: build; step_anatomy (20 warm-up steps, its default) on
      # the seven sets; then on keggdirected and keggundirected with K formed by differences instead of the norm
      # expansion (on clustered points differences were the faster); in one call of at most S11C_BUDGET seconds
      # (default 330). Files: s11c_*.log, s11c_results.tar.gz.
      stage_begin s11c ${S11C_BUDGET:-330} 240
      anatomy "$OUT/s11c_anatomy.log" 120
      ANATOMY_STEM=step_anatomy_diff anatomy "$OUT/s11c_anatomy.log" 60 --datasets keggdirected keggundirected \
        --forward diff
      stage_end s11c ;;
    session11d)
      # Float32's forward with 24 and 28 features in registers (d = 17..28): build (ptxas report); every CUDA test;
      # bench_ops at the engine sets' shapes on Gaussian draws; row c on the seven sets; bench_ops on clustered
      # points; in one call of at most S11D_BUDGET seconds (default 460). Files: s11d_*.log, s11d_results.tar.gz.
      stage_begin s11d ${S11D_BUDGET:-460} 240
      grep -A2 "cov_fwd_stream_kernelIfLi2[48]" "$OUT/s11d_build.log" | grep -E "registers|spill" | head -8
      cuda_tests "$OUT/s11d_tests.log" 130 -rX tests
      for pts in gaussian clustered; do
        [ "$pts" = clustered ] && row_c "$OUT/s11d_uci_c.log" 130
        brun 50 "$OUT/s11d_bench.log" python -m experiments.bench_ops --quick --reps 5 --points $pts \
          --stem "bench_ops_$pts" --shapes 1,14940,14940,18 1,13500,13500,26 1,43945,43948,20 1,57248,57248,27
        echo "bench_ops $pts rc=$?"; cp experiments/results/bench_ops_$pts.* "$res/" 2>/dev/null
        grep -E "^\| \(|^- " "$res/bench_ops_$pts.md"
      done
      stage_end s11d ;;
    session12a)
      # The (lengthscale, outputscale) gradient from the stored K (stored_backward, the engine's default on a GPU)
      # and the symmetric forward (each pair of K(x, x) once, not yet the engine's default): build (ptxas report of
      # their kernels), the compiled library packed as OUTDIR/gpb.tgz; stored_backward's CUDA tests and the
      # engine's that compare the gradient's two sources, then the symmetric forward's (a process of their own);
      # bench_bilinear at the seven sets' shapes; row c on the seven sets; step_anatomy, and on three sets with the
      # symmetric forward; memcheck and racecheck over both; in one call of at most S12A_BUDGET seconds (default
      # 585). Files: s12a_*.log, s12a_results.tar.gz.
      stage_begin s12a ${S12A_BUDGET:-585} 240
      grep -A2 -E "bwd_stored_kernel|Li2ELb1ELb1" "$OUT/s12a_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      pack_build
      cuda_tests "$OUT/s12a_tests.log" 60 tests/test_stored_backward.py tests/test_train.py -k \
        "(stored or same_steps or products_agree or three_times) and not symmetric"
      cuda_tests "$OUT/s12a_tests_sym.log" 40 tests/test_stored_backward.py -k symmetric
      brun 60 "$OUT/s12a_bench.log" python -m experiments.bench_bilinear --reps 5 --stem bench_bilinear_stored \
        --out "$res"; echo "bench_bilinear rc=$?"; grep -E "^\| " "$res/bench_bilinear_stored.md" | cut -d'|' -f1-16
      row_c "$OUT/s12a_uci_c.log" 130
      anatomy "$OUT/s12a_anatomy.log" 110 --forward-layout padded
      ANATOMY_STEM=step_anatomy_symmetric anatomy "$OUT/s12a_anatomy.log" 50 --forward-layout symmetric \
        --datasets keggundirected keggdirected pol
      sanitizers "$OUT/s12a_sanitize.log" 25 --only stored
      stage_end s12a ;;
    session12b)
      # The symmetric forward as the engine's default (and its gradient from the stored K only in stored mode): build
      # (from OUTDIR's gpb.tgz of session12a when the sources match); the CUDA tests of the engine and of
      # stored_backward; row c on the seven sets; step_anatomy on the seven sets; in one call of at most
      # S12B_BUDGET seconds (default 420). Files: s12b_*.log, s12b_results.tar.gz.
      stage_begin s12b ${S12B_BUDGET:-420} 240
      cuda_tests "$OUT/s12b_tests.log" 90 tests/test_stored_backward.py tests/test_train.py
      row_c "$OUT/s12b_uci_c.log" 130
      anatomy "$OUT/s12b_anatomy.log" 110
      stage_end s12b ;;
    session13a)
      # The stored product reading half of K(x, x) (symmetric_matmul, the engine's default on one GPU): build
      # (ptxas report of its kernel), the compiled library packed as OUTDIR/gpb.tgz; its CUDA tests and the dense
      # product's; bench_symmetric_product at the seven sets' sizes (every super-tile against dense_matmul);
      # step_anatomy on the seven sets, and on three with the full-read product; row c on the seven sets; memcheck
      # and racecheck over the stored-K kernels; in one call of at most S13A_BUDGET seconds (default 585). Files:
      # s13a_*.log, s13a_results.tar.gz.
      stage_begin s13a ${S13A_BUDGET:-585} 240
      grep -A2 -E "sym_matmul_kernel" "$OUT/s13a_build.log" | grep -E "registers|spill" | sort | uniq -c | head -6
      pack_build
      cuda_tests "$OUT/s13a_tests.log" 60 tests/test_symmetric_matmul.py tests/test_dense_matmul.py
      brun 70 "$OUT/s13a_bench.log" python -m experiments.bench_symmetric_product --reps 10 --out "$res"
      echo "bench_symmetric_product rc=$?"; grep -E "^\| " "$res/bench_symmetric_product.md"
      anatomy "$OUT/s13a_anatomy.log" 110
      ANATOMY_STEM=step_anatomy_full anatomy "$OUT/s13a_anatomy.log" 50 --product-layout full \
        --datasets keggundirected protein pol
      row_c "$OUT/s13a_uci_c.log" 130
      cuda_tests "$OUT/s13a_tests_engine.log" 50 tests/test_train.py tests/test_stored_backward.py -k \
        "same_steps or products_agree or symmetric"
      sanitizers "$OUT/s13a_sanitize.log" 30 --only stored
      stage_end s13a ;;
    session13b)
      # The preconditioner's two products an iteration by gpfast's bandwidth kernel (its factor and a transposed
      # copy), the engine's product reading half of K only for more than 12 columns, the half-read kernel's
      # argument errors without integers streamed into TORCH_CHECK and its 5-stage variant at 256: build (the
      # library packed as OUTDIR/gpb.tgz); the engine's, the preconditioner's and the half-read product's CUDA tests;
      # bench_symmetric_product at three sizes with the 5-stage variant; Nsight Compute's limiters of the half-read
      # kernel at n = 36,000 (pipes, warp stalls); step_anatomy and row c on the seven sets; racecheck over the
      # half-read kernel alone (with the other stored kernels it passed 30 s); in one call of at most S13B_BUDGET
      # seconds (default 585). Files: s13b_*.log, s13b_results.tar.gz.
      stage_begin s13b ${S13B_BUDGET:-585} 240
      pack_build
      cuda_tests "$OUT/s13b_tests.log" 80 tests/test_symmetric_matmul.py tests/test_train.py \
        tests/test_stored_backward.py tests/test_pivoted_cholesky.py tests/test_cuda_graphs.py
      brun 40 "$OUT/s13b_bench.log" python -m experiments.bench_symmetric_product --reps 10 --out "$res" \
        --sizes 13500 36000 57248; echo "bench_symmetric_product rc=$?"
      grep -E "^\| " "$res/bench_symmetric_product.md" | cut -d'|' -f2-8
      brun 60 "$OUT/s13b_ncu.log" ncu --kernel-name regex:sym_matmul_kernel --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy python -m experiments.bench_symmetric_product \
        --sizes 36000 --t 11 --blocks 512 --reps 1 --out /tmp/s13b_ncu; echo "ncu rc=$?"
      grep -E "Throughput|Pipe|Stall|Issue|Warp Cycles|Executed Ipc|Eligible|Active Warps|Busy" \
        "$OUT/s13b_ncu.log" | head -40
      anatomy "$OUT/s13b_anatomy.log" 110
      row_c "$OUT/s13b_uci_c.log" 130
      brun 60 "$OUT/s13b_sanitize.log" compute-sanitizer --tool racecheck --error-exitcode 3 \
        python -m experiments.sanitize_ops --only symmetric; echo "racecheck rc=$?"
      grep -E "RACECHECK SUMMARY|ran|Error" "$OUT/s13b_sanitize.log" | head -4
      stage_end s13b ;;
    session14a)
      # The pivoted Cholesky's block in 13 launches: the diagonal's update and the next candidates in one
      # kernel (_pivot_select, instead of torch.topk and five elementwise ops), the pivots with their factor G and
      # its inverse in another (_pivot_block): build (the library packed as OUTDIR/gpb.tgz); the tests of both ops,
      # the preconditioner's, the graphs' and the engine's (with the half-read product's, unrun since its helpers
      # moved); memcheck and racecheck over both kernels; bench_preconditioner on keggdirected (ranks 100, 400 and
      # 3200, 16 and 32 pivots a block, the kernels of one build) and pol at rank 3200; step_anatomy and row c on
      # the seven sets; in one call of at most S14A_BUDGET seconds (default 585). Files: s14a_*.log,
      # s14a_results.tar.gz.
      stage_begin s14a ${S14A_BUDGET:-585} 240
      pack_build
      cuda_tests "$OUT/s14a_tests.log" 100 tests/test_pivoted_cholesky.py tests/test_cuda_graphs.py \
        tests/test_train.py tests/test_symmetric_matmul.py tests/test_noise_free.py
      sanitizers "$OUT/s14a_sanitize.log" 40 --only pivot
      brun 80 "$OUT/s14a_precond.log" python -m experiments.bench_preconditioner --dataset keggdirected \
        --kernels 12 --data-dir .data/uci --out "$res"; echo "bench_preconditioner rc=$?"
      grep -E "^\| " "$res/bench_preconditioner.md" | cut -d'|' -f2-9
      brun 50 "$OUT/s14a_precond_pol.log" python -m experiments.bench_preconditioner --dataset pol --kernels 8 \
        --data-dir .data/uci --ranks 3200 --stem bench_preconditioner_pol --out "$res"
      echo "bench_preconditioner pol rc=$?"; grep -E "^\| " "$res/bench_preconditioner_pol.md" | cut -d'|' -f2-9
      anatomy "$OUT/s14a_anatomy.log" 110
      row_c "$OUT/s14a_uci_c.log" 130
      stage_end s14a ;;
    session14b)
      # step_anatomy and row c on the seven sets (a change to the rebuild model changes only when the engine
      # rebuilds); in one call of at most S14B_BUDGET seconds (default 300). Files: s14b_*.log, s14b_results.tar.gz.
      stage_begin s14b ${S14B_BUDGET:-300} 240
      anatomy "$OUT/s14b_anatomy.log" 110
      row_c "$OUT/s14b_uci_c.log" 130
      stage_end s14b ;;
    session14c)
      # Every CUDA test and memcheck over every kernel (experiments.sanitize_ops) on the session's last build
      # (OUTDIR/gpb.tgz of session14a carried as .gpb/gpb.tgz: no compile when the sources match); in one call of at
      # most S14C_BUDGET seconds (default 400). Files: s14c_*.log.
      stage_begin s14c ${S14C_BUDGET:-400} 240
      cuda_tests "$OUT/s14c_tests.log" 220 tests
      sanitizer memcheck "$OUT/s14c_sanitize.log" 150
      stage_end s14c ;;
    session14d)
      # racecheck over every kernel (experiments.sanitize_ops) on a carried build, given 225 s to finish (under the
      # kernels stage's 75 s it was cut before the end); S14D_BUDGET (default 260). Files: s14d_*.log.
      stage_begin s14d ${S14D_BUDGET:-260} 240
      sanitizer racecheck "$OUT/s14d_racecheck.log" 225
      stage_end s14d ;;
    session15)
      # A rebuild that the lengthscale or age rule asks for waits for the iterations the preconditioner's ageing
      # added (each step's beyond the fewest since the build), compare's CUDA warm-up takes 8192 points and two
      # steps, and the rows record the fit's phases (ExactGP.fit_seconds_): build (packed as OUTDIR/gpb.tgz); the
      # engine's, graphs', estimator's, checkpoints' and save files' CUDA tests; row c on the seven sets; row a
      # (stock GPyTorch) on the six that it finishes, in the same call; row c rebuilding whenever asked
      # (rebuild_cost_share=0), the reference without deferral; in one call of at most S15_BUDGET seconds
      # (default 560). Files: s15_*.log, s15_results.tar.gz.
      stage_begin s15 ${S15_BUDGET:-560} 240
      pack_build
      cuda_tests "$OUT/s15_tests.log" 90 tests/test_train.py tests/test_cuda_graphs.py tests/test_estimator.py \
        tests/test_checkpoint.py tests/test_persistence.py
      row_c "$OUT/s15_uci_c.log" 150
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_c.md" | cut -d'|' -f2,25
      brun 130 "$OUT/s15_uci_a.log" "${UCI[@]}" --rows gpytorch --datasets pol elevators bike kin40k protein \
        keggdirected --stem uci_all_a --out "$res"; echo "uci a rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_a.md" | cut -d'|' -f2,7,12,13
      brun 130 "$OUT/s15_uci_c0.log" "${UCI[@]}" --rows gpfast --cg rebuild_cost_share=0 --stem uci_all_c0 \
        --out "$res"; echo "uci c0 rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_c0.md" | cut -d'|' -f2,7,9,10,12,13
      stage_end s15 ;;
    session15b)
      # The three rebuild rules side by side in one call, on session15's build (carried as .gpb/gpb.tgz): row c
      # with the first form of the deferral rule (every iteration since the build counted; that form's
      # gpfast/train/state.py carried as .gpb/state_first_rule.py, run from a copy of the tree), row c rebuilding
      # whenever asked (rebuild_cost_share=0), then row c with the current rule; at most S15B_BUDGET seconds
      # (default 330). Files: s15b_*.log, s15b_results.tar.gz.
      stage_begin s15b ${S15B_BUDGET:-330} 240
      rm -rf /tmp/first && mkdir /tmp/first && cp -r gpfast experiments COMMIT /tmp/first/ && ln -s "$PWD/.data" /tmp/first/.data
      cp .gpb/state_first_rule.py /tmp/first/gpfast/train/state.py
      (cd /tmp/first && PYTHONPATH=/tmp/first brun 100 "$OUT/s15b_uci_first.log" "${UCI[@]}" --rows gpfast \
        --stem uci_all_c_first --out "$res"); echo "uci first rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_c_first.md" | cut -d'|' -f2,7,9,10,12,13,24
      brun 100 "$OUT/s15b_uci_c0.log" "${UCI[@]}" --rows gpfast --cg rebuild_cost_share=0 --stem uci_all_c0 \
        --out "$res"; echo "uci c0 rc=$?"
      grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_c0.md" | cut -d'|' -f2,7,9,10,12,13,24
      row_c "$OUT/s15b_uci_c.log" 100
      stage_end s15b ;;
    session16)
      # autograd's float32 covariance backward on a GPU reads the forward's K (backward_stored.cuh, kDense) instead
      # of recomputing every exponential: build (packed as OUTDIR/gpb.tgz); every CUDA test; bench_ops on its four
      # shapes with the backward op alone (GPyTorch beside); the accuracy probes of the covariance backward (every
      # kernel, shifted points) and of the tensor-core (l, s) backward of K @ V; memcheck over the covariance
      # backward's kernels; row b (GPyTorch with gpfast's kernel) on pol, elevators and bike; in one call of at most
      # S16_BUDGET seconds (default 570). Files: s16_*.log, s16_results.tar.gz.
      stage_begin s16 ${S16_BUDGET:-570} 240
      pack_build
      cuda_tests "$OUT/s16_tests.log" 150 tests
      brun 110 "$OUT/s16_bench_ops.log" python -m experiments.bench_ops --quick --reps 10 --bwd-op --stem bench_ops_from_k
      echo "bench_ops rc=$?"; cp experiments/results/bench_ops_from_k.* "$res/"; grep -E "^- \(" "$res/bench_ops_from_k.md"
      brun 70 "$OUT/s16_probe.log" python -m experiments.backward_f32_probe --draws 150 --emulate 3
      echo "backward_f32_probe rc=$?"; cp experiments/results/backward_f32_probe.* "$res/"
      grep -E "^\| " "$res/backward_f32_probe.md" | head -30
      brun 60 "$OUT/s16_bilinear_probe.log" python -m experiments.bilinear_rule_probe --draws 250
      echo "bilinear_rule_probe rc=$?"; cp experiments/results/bilinear_rule_probe.* "$res/"
      grep -E "^\| " "$res/bilinear_rule_probe.md"
      sanitizer memcheck "$OUT/s16_memcheck.log" 60 --only backward
      brun 80 "$OUT/s16_uci_b.log" "${UCI[@]}" --rows gpytorch+gpfast --datasets pol elevators bike --stem uci_b \
        --out "$res"; echo "uci b rc=$?"
      grep -E "^\| (pol|elevators|bike)" "$res/uci_b.md" | cut -d'|' -f2,7,12,13
      stage_end s16 ;;
    session16b)
      # autograd back on the backward that recomputes the exponentials, the outputscale's bound for a cancelling sum
      # in the K @ V backward's tests: every CUDA test, bilinear_rule_probe with the tests' rule, racecheck over the
      # covariance backward's kernels (the from-K variant among them), on session16's build (carried as
      # .gpb/gpb.tgz); at most S16B_BUDGET seconds (default 330). Files: s16b_*.log, s16b_results.tar.gz.
      stage_begin s16b ${S16B_BUDGET:-330} 240
      cuda_tests "$OUT/s16b_tests.log" 170 tests
      brun 80 "$OUT/s16b_bilinear_probe.log" python -m experiments.bilinear_rule_probe --draws 400
      echo "bilinear_rule_probe rc=$?"; cp experiments/results/bilinear_rule_probe.* "$res/"
      grep -E "^\| " "$res/bilinear_rule_probe.md"
      sanitizer racecheck "$OUT/s16b_racecheck.log" 60 --only backward
      stage_end s16b ;;
    session16c)
      # Row c on the seven sets on session16's build (carried as .gpb/gpb.tgz), for the engine's stored-K backward
      # kernel, whose source gained the from-K variant's branches; at most S16C_BUDGET seconds (default 150).
      # Files: s16c_*.log, s16c_results.tar.gz.
      stage_begin s16c ${S16C_BUDGET:-150} 240
      row_c "$OUT/s16c_uci_c.log" 120
      stage_end s16c ;;
    session17)
      # What lands at the end of the covariance-backward work, checked whole: build (packed as OUTDIR/gpb.tgz);
      # every CUDA test (the estimator's among them, whose L-BFGS-B stops on a flat loss are now judged by the
      # steepest-descent line's bound); memcheck over every kernel (experiments.sanitize_ops); in one call of at
      # most S17_BUDGET seconds (default 560). Files: s17_*.log, s17_results.tar.gz.
      stage_begin s17 ${S17_BUDGET:-560} 240
      pack_build
      cuda_tests "$OUT/s17_tests.log" 200 tests
      sanitizer memcheck "$OUT/s17_memcheck.log" 180
      stage_end s17 ;;
    session17b)
      # racecheck over every kernel (experiments.sanitize_ops) on session17's build (carried as .gpb/gpb.tgz),
      # given 260 s to finish; at most S17B_BUDGET seconds (default 300). Files: s17b_*.log.
      stage_begin s17b ${S17B_BUDGET:-300} 240
      sanitizer racecheck "$OUT/s17b_racecheck.log" 260
      stage_end s17b ;;
    session18)
      # Row c on the seven sets under five engine settings, in one call so that they share the machine's state:
      # the defaults, larger pivot blocks (a rank-3200 build of pol replayed in 27 against 40 ms), a lower rank
      # limit (pol's preconditioner apply at rank 3200 cost more than its product), both, and larger blocks with a
      # laxer rescaling rule; then step_anatomy on the defaults, with what the device waits for; on a carried build
      # (.gpb/gpb.tgz); at most S18_BUDGET seconds (default 560). Files: s18_*.log, s18_results.tar.gz.
      stage_begin s18 ${S18_BUDGET:-560} 240
      for cfg in "default" "pivot_block=32" "max_preconditioner_rank=1600" \
                 "pivot_block=32 max_preconditioner_rank=1600" "pivot_block=32 rescale_change=0.3"; do
        cgargs=(); [ "$cfg" != default ] && cgargs=(--cg $cfg)
        row_c "$OUT/s18_uci.log" 80 "uci_all_c_$(echo "$cfg" | sed -e 's/ /_/g; s/=/-/g; s/\./p/g')" "${cgargs[@]}"
      done
      anatomy "$OUT/s18_anatomy.log" 130
      stage_end s18 ;;
    session18b)
      # The engine's new defaults (32 pivots a block; the rank limit the last doubling within n / 8): every CUDA
      # test; row c on the seven sets; step_anatomy, with what the device waits for attributed by time to the
      # host's launches; on a carried build (.gpb/gpb.tgz); at most S18B_BUDGET seconds (default 540). Files:
      # s18b_*.log, s18b_results.tar.gz.
      stage_begin s18b ${S18B_BUDGET:-540} 240
      row_c "$OUT/s18b_uci_c.log" 90
      anatomy "$OUT/s18b_anatomy.log" 130
      cuda_tests "$OUT/s18b_tests.log" 200 tests
      stage_end s18b ;;
    session19)
      # ExactGP's fit stepping by the engine's natural path (the hyperparameters to the device in one copy, no
      # constraints or autograd) with gpfast's numpy Adam: row c on the seven sets; the kept CG graph's tests;
      # row c with the CG graph kept across steps (cuda_graph_reuse); cg_graph_cost (a CG solve's graph captured
      # per solve against one kept); step_anatomy stepping as the fit does; every CUDA test; on a carried build
      # (.gpb/gpb.tgz); at most S19_BUDGET seconds (default 580). Files: s19_*.log, s19_results.tar.gz.
      stage_begin s19 ${S19_BUDGET:-580} 240
      row_c "$OUT/s19_uci_c.log" 90
      cuda_tests "$OUT/s19_kept_tests.log" 60 tests/test_cuda_graphs.py
      row_c "$OUT/s19_uci_c_reuse.log" 90 uci_all_c_cuda_graph_reuse --cg cuda_graph_reuse=True
      brun 60 "$OUT/s19_graph_cost.log" python -m experiments.cg_graph_cost --out "$res"
      echo "cg_graph_cost rc=$?"; grep -E "^\|" "$res/cg_graph_cost.md"
      anatomy "$OUT/s19_anatomy.log" 120
      cuda_tests "$OUT/s19_tests.log" 200 tests
      stage_end s19 ;;
    session20)
      # No synchronous host-to-device copies inside a step (the warm residual's column index, the natural path's
      # values), new scales written into the preconditioner's tensors, against the tree before (b25df09, unpacked
      # beforehand into .gpb/old with `git archive b25df09 gpfast experiments ':!experiments/results' | tar x -C
      # .gpb/old` and `echo b25df09 > .gpb/old/COMMIT`, which its tables name; the same CUDA sources, so the same
      # build), in value order: build (packed as OUTDIR/gpb.tgz);
      # row c on the seven sets after, and after with the CG graph kept across steps (cuda_graph_reuse); the kept
      # graph's tests; row c before; step_anatomy with and without the kept graph; row c on pol, elevators and
      # bike at the rank limit 800 (n / 16 there); every CUDA test; cg_graph_cost; at most S20_BUDGET seconds
      # (default 560). Files: s20_logs.tar.gz, s20_results.tar.gz, gpb.tgz.
      stage_begin s20 ${S20_BUDGET:-560} 240
      pack_build
      row_c "$OUT/s20_uci_c.log" 90
      row_c "$OUT/s20_uci_c_reuse.log" 90 uci_all_c_cuda_graph_reuse --cg cuda_graph_reuse=True
      cuda_tests "$OUT/s20_kept_tests.log" 60 tests/test_cuda_graphs.py
      row_c_before "$OUT/s20_uci_c_before.log" 90
      ANATOMY_STEM=step_anatomy_reuse anatomy "$OUT/s20_anatomy_reuse.log" 100 --options '{"cuda_graph_reuse": true}'
      anatomy "$OUT/s20_anatomy.log" 100
      row_c "$OUT/s20_uci_c_rank800.log" 40 uci_small_c_rank800 --datasets pol elevators bike \
        --cg max_preconditioner_rank=800
      cuda_tests "$OUT/s20_tests.log" 150 tests
      brun 60 "$OUT/s20_graph_cost.log" python -m experiments.cg_graph_cost --out "$res"
      echo "cg_graph_cost rc=$?"; grep -E "^\|" "$res/cg_graph_cost.md"
      # the logs in one file too: the device tool brings back at most 8 files
      pack_logs s20
      stage_end s20 ;;
    session20b)
      # CGSettings.cuda_graph_reuse the default: every CUDA test, on a carried build (.gpb/gpb.tgz, session20's:
      # the CUDA sources are the same) or a fresh one (about 110 s); at most S20B_BUDGET seconds (default 320).
      # Files: s20b_*.log, s20b_results.tar.gz.
      stage_begin s20b ${S20B_BUDGET:-320} 200
      cuda_tests "$OUT/s20b_tests.log" 170 tests
      stage_end s20b ;;
    session21)
      # The kept CG graph the default, on the H200: row c on the seven sets, step_anatomy, every CUDA test, on a
      # carried build (.gpb/gpb.tgz) or a fresh one; at most S21_BUDGET seconds (default 460).
      # Files: s21_logs.tar.gz, s21_results.tar.gz (gpb.tgz when built here).
      stage_begin s21 ${S21_BUDGET:-460} 200
      [ -s .gpb/gpb.tgz ] || pack_build
      row_c "$OUT/s21_uci_c.log" 80
      anatomy "$OUT/s21_anatomy.log" 100
      cuda_tests "$OUT/s21_tests.log" 180 tests
      pack_logs s21
      stage_end s21 ;;
    session21b)
      # The preconditioner's gram by its upper triangle's blocks and the posterior's Cholesky by blocks, against the
      # tree before (unpacked beforehand into .gpb/old with `git archive SHA gpfast experiments ':!experiments/results'
      # | tar x -C .gpb/old` and `echo SHA > .gpb/old/COMMIT`; the same CUDA sources, so the same build), in value
      # order: bench_cholesky (both factorisations, every variant); bench_cg_vectors; row c after; row c before;
      # step_anatomy after; the CUDA tests of the files touched; at most S21B_BUDGET seconds (default 420).
      # Files: s21b_logs.tar.gz, s21b_results.tar.gz (gpb.tgz when built here).
      stage_begin s21b ${S21B_BUDGET:-420} 200
      [ -s .gpb/gpb.tgz ] || pack_build
      brun 90 "$OUT/s21b_cholesky.log" python -m experiments.bench_cholesky --out "$res"
      echo "bench_cholesky rc=$?"; grep -E "^\|" "$res/bench_cholesky.md"
      brun 40 "$OUT/s21b_cg_vectors.log" python -m experiments.bench_cg_vectors --out "$res"
      echo "bench_cg_vectors rc=$?"; grep -E "^\|" "$res/bench_cg_vectors.md"
      row_c "$OUT/s21b_uci_c.log" 80
      row_c_before "$OUT/s21b_uci_c_before.log" 80
      anatomy "$OUT/s21b_anatomy.log" 80
      cuda_tests "$OUT/s21b_tests.log" 60 tests/test_models.py tests/test_pivoted_cholesky.py tests/test_train.py \
        tests/test_cuda_graphs.py
      pack_logs s21b
      stage_end s21b ;;
    session21c)
      # What lands: the gram by blocks from rank 1600 on, cuSOLVER's Cholesky kept, the natural path's buffer
      # without a numpy view or an unconditional event wait: every CUDA test, row c, step_anatomy; at most S21C_BUDGET seconds
      # (default 400). Files: s21c_logs.tar.gz, s21c_results.tar.gz (gpb.tgz when built here).
      stage_begin s21c ${S21C_BUDGET:-400} 200
      [ -s .gpb/gpb.tgz ] || pack_build
      cuda_tests "$OUT/s21c_tests.log" 170 tests
      row_c "$OUT/s21c_uci_c.log" 80
      anatomy "$OUT/s21c_anatomy.log" 80
      pack_logs s21c
      stage_end s21c ;;
    session21d)
      # The review mends (the gram's in-place symmetrisation and autograd fallback, the natural path's copy of its
      # values and its test against the values read back): the CUDA tests of the files touched; at most
      # S21D_BUDGET seconds (default 150). Files: s21d_tests.log.
      budget_start ${S21D_BUDGET:-150}
      export TORCH_CUDA_ARCH_LIST=9.0
      cuda_tests "$OUT/s21d_tests.log" 140 tests/test_pivoted_cholesky.py tests/test_train.py tests/test_cuda_graphs.py ;;
    session22)
      # Rows a and c side by side on the seven sets, row a timed for its training only (stock GPyTorch's prediction
      # takes minutes on the larger sets); the CUDA tests of the last review's files; step_anatomy; on a carried
      # build (.gpb/gpb.tgz) or a fresh one; at most S22_BUDGET seconds (default 480). Files: s22_logs.tar.gz,
      # s22_results.tar.gz (gpb.tgz when built here).
      stage_begin s22 ${S22_BUDGET:-480} 200
      [ -s .gpb/gpb.tgz ] || pack_build
      cuda_tests "$OUT/s22_tests.log" 100 tests/test_pivoted_cholesky.py tests/test_train.py tests/test_cuda_graphs.py
      brun 260 "$OUT/s22_uci_ac.log" "${UCI[@]}" --rows gpytorch gpfast --predict gpfast --stem uci_all_ac --out "$res"
      echo "uci ac rc=$?"; grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_ac.md" | cut -d'|' -f2,5,7,9,10,12,13,18
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/s22_uci_ac.log")"
      anatomy "$OUT/s22_anatomy.log" 80
      pack_logs s22
      stage_end s22 ;;
    session22b)
      # Data for the next steps, in value order: preconditioner_forms on all of protein and of kin40k (where the
      # engine's 20 Adam steps go: its rank-1600 and rank-3200 low-rank form against the diagonal correction,
      # block-Jacobi and low-rank plus blocks, at blocks of 1024, 2048 and 4096 points); Nsight Compute's full set over
      # K @ V's tensor-core kernel (kv_tc_kernel, n = 200,000, d = 8, t = 16) and over the covariance forward at
      # (4, 8192, 8192, 32), each with its details page and its SASS with per-instruction counters; on a carried build
      # (.gpb/gpb.tgz) or a fresh one; at most S22B_BUDGET seconds (default 480). Files: s22b_logs.tar.gz,
      # s22b_results.tar.gz (gpb.tgz when built here).
      stage_begin s22b ${S22B_BUDGET:-480} 200
      [ -s .gpb/gpb.tgz ] || pack_build
      for set in protein kin40k; do
        brun 150 "$OUT/s22b_forms.log" python -m experiments.preconditioner_forms --dataset $set --data-dir .data/uci \
          --subset 0 --steps 20 --ranks 1600 3200 --blocks 1024 2048 4096 --device cuda --stem preconditioner_forms_$set \
          --out "$res"
        echo "preconditioner_forms $set rc=$?"; grep -E "^\| " "$res/preconditioner_forms_$set.md"
      done
      for op in kv cov_fwd; do
        ncu_pages "$OUT/s22b_ncu.log" 120 ncu_$op --op $op
        grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|No Eligible|Compute \(SM\) Thr|Memory Thr" \
          "$res/ncu_${op}_details.txt" | head -12
        grep -iE "pipe|ALU|FMA|XU|Tensor" "$res/ncu_${op}_details.txt" | head -12
        ls -la "$res"/ncu_${op}*
      done
      pack_logs s22b
      stage_end s22b ;;
    session22c)
      # K @ V's tensor-core kernel with two row tiles a warp and with the compensated addition every two tiles, in
      # value order: build (ptxas's registers and spills of kv_tc_kernel; packed as OUTDIR/gpb.tgz); bench_matmul's
      # kernels at 10^6 points (d = 8, t = 16), the default against the five new variants, with their errors; the
      # K @ V CUDA tests (every variant); memcheck over the K @ V kernels; at most S22C_BUDGET seconds (default 560).
      # Files: s22c_logs.tar.gz, s22c_results.tar.gz, gpb.tgz.
      stage_begin s22c ${S22C_BUDGET:-560} 330
      pack_build
      grep -A2 "kv_tc_kernel" "$OUT/s22c_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      kv_kernels "$OUT/s22c_bench.log" 150 bench_matmul_s22 1000000 tc tc_mt2 tc_mt2w4 tc_mt2w4b3 tc_g2 tc_mt2w4g2
      cuda_tests "$OUT/s22c_tests.log" 150 tests/test_cuda_kernels.py tests/test_ops.py -k "matmul"
      sanitizer memcheck "$OUT/s22c_sanitize.log" 80 --only matmul
      pack_logs s22c
      stage_end s22c ;;
    session22d)
      # K @ V's tensor-core default at d <= 8, 9 <= t <= 16 with two row tiles a warp (tc_mt2w4b3's instance), in
      # value order: build (packed as OUTDIR/gpb.tgz); every CUDA test; bench_matmul's kernels at 10^6 points (the
      # default against tc_isplit, the one-tile form, and tc_mt2w4b3); the 1M engine step (one timed step after the
      # warm-up); at most S22D_BUDGET seconds (default 580). Files: s22d_logs.tar.gz, s22d_results.tar.gz, gpb.tgz.
      stage_begin s22d ${S22D_BUDGET:-580} 330
      pack_build
      cuda_tests "$OUT/s22d_tests.log" 200 tests
      kv_kernels "$OUT/s22d_bench.log" 60 bench_matmul_s22d 1000000 tc tc_isplit tc_mt2w4b3
      brun 150 "$OUT/s22d_engine1m.log" python -m experiments.engine_step --n 1000000 --d 8 --steps 1 --out "$res"
      echo "engine_step rc=$?"; tail -8 "$OUT/s22d_engine1m.log"
      pack_logs s22d
      stage_end s22d ;;
    session22e)
      # Nsight Compute's full set over K @ V's two-tile default (profile_ops --op kv: n = 200,000, d = 8, t = 16), its
      # details page and its SASS with per-instruction counters, on a carried build (.gpb/gpb.tgz; the CUDA sources
      # of call 4); at most S22E_BUDGET seconds (default 120). Files: s22e_results.tar.gz.
      stage_begin s22e ${S22E_BUDGET:-120} 100
      ncu_pages "$res/ncu.log" 80 ncu_kv2 --op kv
      grep -E "kv_tc_kernel|Duration|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occupancy" \
        "$res/ncu_kv2_details.txt" | tail -8
      stage_end s22e ;;
    session23)
      # The pivoted Cholesky's block kernels (_pivot_block over 256 threads with one barrier a pivot; _pivot_select
      # loading four rows of Lb at a time): their CUDA tests with the engine's and the graphs', the sanitizers over
      # them, Nsight Compute over one call of each at pol's shape, row c of the tree before (.gpb/old, whose sources
      # are the carried build's) and after on the seven sets, then step_anatomy; a fresh build, packed for the next
      # call; at most S23_BUDGET seconds (default 560). Files: s23_logs.tar.gz, s23_results.tar.gz, gpb.tgz.
      stage_begin s23 ${S23_BUDGET:-560} 240
      pack_build
      cuda_tests "$OUT/s23_tests.log" 150 tests/test_pivoted_cholesky.py tests/test_cuda_graphs.py tests/test_train.py
      sanitizers "$OUT/s23_sanitize.log" 60 --only pivot
      ncu_pivot "$OUT/s23_ncu.log" 40 2
      row_c_before "$OUT/s23_uci_c_before.log" 150
      row_c "$OUT/s23_uci_c.log" 150
      anatomy "$OUT/s23_anatomy.log" 100
      pack_logs s23
      stage_end s23 ;;
    session23b)
      # The pivoted Cholesky's block kernels after session23's profile: the diagonal's update in a kernel of its own
      # over all the points, the selection's run merges spread over warps, one division a pivot and a lane-parallel
      # inverse of G in _pivot_block (the CPU op takes the same steps); their CUDA tests, the sanitizers, Nsight
      # Compute, step_anatomy, then row c of the tree before (.gpb/old, the carried build's sources) and after; a
      # fresh build; at most S23B_BUDGET seconds (default 540). Files: s23b_logs.tar.gz, s23b_results.tar.gz.
      stage_begin s23b ${S23B_BUDGET:-540} 240
      cuda_tests "$OUT/s23b_tests.log" 150 tests/test_pivoted_cholesky.py tests/test_cuda_graphs.py tests/test_train.py
      sanitizers "$OUT/s23b_sanitize.log" 60 --only pivot
      ncu_pivot "$OUT/s23b_ncu.log" 60 3
      anatomy "$OUT/s23b_anatomy.log" 100
      row_c_before "$OUT/s23b_uci_c_before.log" 150
      row_c "$OUT/s23b_uci_c.log" 150
      pack_logs s23b
      stage_end s23b ;;
    session23c)
      # The diagonal's update with all of Lb's rows in flight; its CUDA tests and memcheck; row c before (.gpb/old)
      # and after on pol, elevators and bike, twice, alternating (session23b saw the first steps slower after, the
      # later ones faster: noise or not); rows a and c with their predictions on the same sets (the end-to-end
      # ratio); Nsight Compute over the pivot kernels; step_anatomy on the three sets; a fresh build; at most
      # S23C_BUDGET seconds (default 600). Files: s23c_logs.tar.gz, s23c_results.tar.gz.
      stage_begin s23c ${S23C_BUDGET:-600} 240
      cuda_tests "$OUT/s23c_tests.log" 60 tests/test_pivoted_cholesky.py
      sanitizer memcheck "$OUT/s23c_sanitize.log" 40 --only pivot
      small=(--datasets pol elevators bike)
      for rep in 1 2; do
        [ -d .gpb/old/gpfast ] && (cd .gpb/old && PYTHONPATH=$PWD brun 60 "$OUT/s23c_uci_c.log" python -m \
          experiments.uci_table --data-dir ../../.data/uci --device cuda --splits 0 --iters 50 --lr 0.1 --quiet \
          --rows gpfast "${small[@]}" --stem uci_small_c_before_$rep --out "$res")
        echo "before $rep rc=$?"; row_c_columns "$res/uci_small_c_before_$rep.md"
        brun 60 "$OUT/s23c_uci_c.log" "${UCI[@]}" --rows gpfast "${small[@]}" --stem uci_small_c_after_$rep --out "$res"
        echo "after $rep rc=$?"; row_c_columns "$res/uci_small_c_after_$rep.md"
      done
      brun 200 "$OUT/s23c_uci_ac.log" "${UCI[@]}" --rows gpytorch gpfast "${small[@]}" --stem uci_small_ac --out "$res"
      echo "uci ac rc=$?"; grep -E "^\| (pol|elevators|bike)" "$res/uci_small_ac.md" | cut -d'|' -f2,5,7,11,12,13,17,18
      ncu_pivot "$OUT/s23c_ncu.log" 60 3
      anatomy "$OUT/s23c_anatomy.log" 60 "${small[@]}"
      pack_logs s23c
      stage_end s23c ;;
    session23d)
      # The last mends of the pivot kernels (the update launched at the first block too, where it clamps d; Lb's rows
      # in chunks of 32 for r up to 64): test_pivoted_cholesky's CUDA tests, then memcheck over the pivot steps; a
      # fresh build; at most S23D_BUDGET seconds (default 230). Files: s23d_logs.tar.gz.
      stage_begin s23d ${S23D_BUDGET:-230} 200
      cuda_tests "$OUT/s23d_tests.log" 40 tests/test_pivoted_cholesky.py
      sanitizer memcheck "$OUT/s23d_sanitize.log" 30 --only pivot
      pack_logs s23d
      rm -rf "$res" ;;
    session24a)
      # The preconditioner's factor kept in float16 (CGSettings.preconditioner_storage; not the default): a fresh
      # build, then, in value order, the CUDA tests of the float16-K product, the preconditioner and the engine;
      # memcheck over the float16-K product; row c on the seven sets with the factor in float32 (the default) and
      # in float16, twice each, alternating; step_anatomy with float16 (its kernel table has the factor's products);
      # at most S24A_BUDGET seconds (default 590). Files: s24a_logs.tar.gz, s24a_results.tar.gz.
      stage_begin s24a ${S24A_BUDGET:-590} 240
      cuda_tests "$OUT/s24a_tests.log" 120 tests/test_dense_matmul.py tests/test_train.py tests/test_cuda_graphs.py
      sanitizer memcheck "$OUT/s24a_sanitize.log" 40 --only half
      for rep in 1 2; do
        row_c "$OUT/s24a_uci_c.log" 90 uci_all_c_f32_$rep
        row_c "$OUT/s24a_uci_c.log" 90 uci_all_c_f16_$rep --cg preconditioner_storage=float16
      done
      python -m experiments.step_repeats --before "$res"/uci_all_c_f32_?.json --after "$res"/uci_all_c_f16_?.json \
        --stem step_repeats_f16 --out "$res" | tail -12
      anatomy "$OUT/s24a_anatomy.log" 80 --options '{"preconditioner_storage": "float16"}'
      pack_logs s24a
      stage_end s24a ;;
    session24b)
      # K @ V's tensor-core kernel with the exponent's biases in the MMAs' accumulators (tc_bias, tc_bias_g2; as run
      # in session 24 also with a shifted exponent and a sign-bit near test, tc_shift and tc_shift_g2, since
      # dropped), and the CUDA launchers' checks with their numbers as text (GPF_CHECK), in value order: build
      # (ptxas's registers and spills of kv_tc_kernel); bench_matmul's kernels at 10^6 and 200,000 points (d = 8,
      # t = 16), tc_mt2w4b3's instance (the default then) and the variants, twice in alternation, with their errors; the op-error cases, each in a process
      # of its own; the CUDA tests that session24a's crash cut short (the float16 factor's); the K @ V CUDA tests
      # (every variant); memcheck over the K @ V kernels; at most S24B_BUDGET seconds (default 580). Files:
      # s24b_logs.tar.gz, s24b_results.tar.gz.
      stage_begin s24b ${S24B_BUDGET:-580} 330
      grep -A2 "kv_tc_kernel" "$OUT/s24b_build.log" | grep -E "registers|spill" | sort | uniq -c | head -12
      kvs=(tc_mt2w4b3 tc_bias tc_bias_g2)
      kv_kernels "$OUT/s24b_bench.log" 150 bench_matmul_s24 "1000000 200000" "${kvs[@]}" "${kvs[@]}"
      cuda_tests "$OUT/s24b_errors.log" 90 tests/test_cuda_op_errors.py
      cuda_tests "$OUT/s24b_tests.log" 150 tests/test_dense_matmul.py tests/test_train.py tests/test_cuda_graphs.py
      cuda_tests "$OUT/s24b_kv_tests.log" 150 tests/test_cuda_kernels.py tests/test_ops.py -k "matmul"
      sanitizer memcheck "$OUT/s24b_sanitize.log" 60 --only matmul
      pack_logs s24b
      stage_end s24b ;;
    session24c)
      # K @ V's tensor-core default at d <= 8, 9 <= t <= 16 with the exponent's biases in the MMAs' accumulators and
      # the compensated addition every two tiles (tc_bias_g2's instance), in value order: build; every CUDA test;
      # bench_matmul's kernels at 10^6 points (the default against tc_mt2w4b3, the default before, and tc_bias_g2);
      # the 1M engine step (one timed step after the warm-up); at most S24C_BUDGET seconds (default 540). Files:
      # s24c_logs.tar.gz, s24c_results.tar.gz.
      stage_begin s24c ${S24C_BUDGET:-540} 330
      cuda_tests "$OUT/s24c_tests.log" 200 tests
      kv_kernels "$OUT/s24c_bench.log" 60 bench_matmul_s24c 1000000 tc tc_mt2w4b3 tc_bias_g2
      brun 150 "$OUT/s24c_engine1m.log" python -m experiments.engine_step --n 1000000 --d 8 --steps 1 --out "$res"
      echo "engine_step rc=$?"; tail -8 "$OUT/s24c_engine1m.log"
      pack_logs s24c
      stage_end s24c ;;
    session25a)
      # GPyTorch's loop with gpfast's kernels returning a DenseRBFOperator (K stored; CG's products by dense_matmul,
      # the marginal likelihood's derivative by stored_backward), and two K @ V variants (the compensated addition
      # every four tiles; four blocks an SM), in value order: build (ptxas's registers and spills of kv_tc_kernel),
      # packed for a later call; the CUDA tests of the operator, the kernels, the models and the op-error cases; rows
      # a and b on pol, elevators and bike, training only; row b on the four large sets with K stored (threshold
      # 2^33) and matrix-free (threshold 0; as run in session 26 the default threshold, then 2^30 entries), training
      # only (row a there is not rerun: stock GPyTorch, untouched by the change); gpytorch_step on the three small
      # sets (where a step
      # of GPyTorch's loop goes, either kernel); bench_matmul at 10^6 points, the default and the two variants in
      # alternation; the variants' CUDA tests; memcheck over K @ V; at most S25A_BUDGET seconds (default 590).
      # Files: gpb.tgz, s25a_logs.tar.gz, s25a_results.tar.gz.
      stage_begin s25a ${S25A_BUDGET:-590} 330
      pack_build
      grep -A2 "kv_tc_kernel" "$OUT/s25a_build.log" | grep -E "registers|spill" | sort | uniq -c | head -16
      cuda_tests "$OUT/s25a_tests.log" 100 tests/test_dense_operator.py tests/test_kernels.py tests/test_operator.py \
        tests/test_models.py tests/test_cuda_op_errors.py
      small=(--datasets pol elevators bike) large=(--datasets kin40k protein keggdirected keggundirected)
      brun 80 "$OUT/s25a_uci.log" "${UCI[@]}" --rows gpytorch gpytorch+gpfast --predict "${small[@]}" \
        --stem uci_small_ab --out "$res"
      echo "uci small ab rc=$?"; grep -E "^\| (pol|elevators|bike)" "$res/uci_small_ab.md" | cut -d'|' -f2,5,7
      for form in stored free; do
        thr=(--matrix-free-threshold 0); [ $form = stored ] && thr=(--matrix-free-threshold 8589934592)
        brun 100 "$OUT/s25a_uci.log" "${UCI[@]}" --rows gpytorch+gpfast --predict "${large[@]}" "${thr[@]}" \
          --stem uci_large_b_$form --out "$res"
        echo "uci large b $form rc=$?"; grep -E "^\| (kin40k|protein|kegg)" "$res/uci_large_b_$form.md" | cut -d'|' -f2,5,7
      done
      brun 60 "$OUT/s25a_step.log" python -m experiments.gpytorch_step --data-dir .data/uci --device cuda --out "$res"
      echo "gpytorch_step rc=$?"; grep -E "^(\| |- )" "$res/gpytorch_step.md"
      kvs=(tc tc_bias_g4 tc_bias_g2b4)
      kv_kernels "$OUT/s25a_bench.log" 70 bench_matmul_s25 1000000 "${kvs[@]}" "${kvs[@]}"
      cuda_tests "$OUT/s25a_kv_tests.log" 60 tests/test_cuda_kernels.py -k "matmul_kernels"
      sanitizer memcheck "$OUT/s25a_sanitize.log" 50 --only matmul
      pack_logs s25a
      stage_end s25a ;;
    session26a)
      # The issues' H200 figures that session25a does not give, on session25a's library (carried as .gpb/gpb.tgz)
      # or a fresh build, in value order: rows a (training only) and c side by side on the seven sets; step_anatomy;
      # racecheck, then memcheck, over every kernel (the K @ V variants and the float16-K product are newer than the
      # last full racecheck); the 1M engine step (one timed step after the warm-up); at most S26A_BUDGET seconds
      # (default 580). Files: s26a_logs.tar.gz, s26a_results.tar.gz (gpb.tgz when built here).
      stage_begin s26a ${S26A_BUDGET:-580} 240
      [ -s .gpb/gpb.tgz ] || pack_build
      brun 260 "$OUT/s26a_uci_ac.log" "${UCI[@]}" --rows gpytorch gpfast --predict gpfast --stem uci_all_ac --out "$res"
      echo "uci ac rc=$?"; grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_ac.md" | cut -d'|' -f2,5,7,9,10,12,13,18
      echo "ConvergenceWarnings: $(grep -c ConvergenceWarning "$OUT/s26a_uci_ac.log")"
      anatomy "$OUT/s26a_anatomy.log" 80
      sanitizer racecheck "$OUT/s26a_sanitize.log" 100
      sanitizer memcheck "$OUT/s26a_sanitize.log" 100
      brun 150 "$OUT/s26a_engine1m.log" python -m experiments.engine_step --n 1000000 --d 8 --steps 1 --out "$res"
      echo "engine_step rc=$?"; tail -8 "$OUT/s26a_engine1m.log"
      pack_logs s26a
      stage_end s26a ;;
    session26b)
      # What session25a's shortened run (340 s of its 590) left, with the kernels' threshold at 2^32 entries (K
      # stored on all seven sets), in value order: build (packed for a later call); the CUDA tests of the operator
      # (its CPU-compared test mended), the kernels, the models and the op-error cases; rows a and b side by side on
      # the seven sets, training only; gpytorch_step on the three small sets; bench_matmul at 10^6 points, the
      # default and the two K @ V variants in alternation; the variants' CUDA tests; memcheck over K @ V; at most
      # S26B_BUDGET seconds (default 590). Files: gpb.tgz, s26b_logs.tar.gz, s26b_results.tar.gz.
      stage_begin s26b ${S26B_BUDGET:-590} 330
      [ -s .gpb/gpb.tgz ] || pack_build
      cuda_tests "$OUT/s26b_tests.log" 100 tests/test_dense_operator.py tests/test_kernels.py tests/test_operator.py \
        tests/test_models.py tests/test_cuda_op_errors.py
      brun 260 "$OUT/s26b_uci.log" "${UCI[@]}" --rows gpytorch gpytorch+gpfast --predict --stem uci_all_ab --out "$res"
      echo "uci ab rc=$?"; grep -E "^\| (pol|elevators|bike|kin40k|protein|kegg)" "$res/uci_all_ab.md" | cut -d'|' -f2,5,7,16,19
      brun 60 "$OUT/s26b_step.log" python -m experiments.gpytorch_step --data-dir .data/uci --device cuda --out "$res"
      echo "gpytorch_step rc=$?"; grep -E "^(\| |- )" "$res/gpytorch_step.md"
      kvs=(tc tc_bias_g4 tc_bias_g2b4)
      kv_kernels "$OUT/s26b_bench.log" 70 bench_matmul_s26 1000000 "${kvs[@]}" "${kvs[@]}"
      cuda_tests "$OUT/s26b_kv_tests.log" 60 tests/test_cuda_kernels.py -k "matmul_kernels"
      sanitizer memcheck "$OUT/s26b_sanitize.log" 50 --only matmul
      pack_logs s26b
      stage_end s26b ;;
    session27a)
      # The symmetric matrix-free K(x, x) @ V kernels (each pair of points once for both of its products; run only
      # when named), their first run, in value order: a fresh build (packed for a later call); their CUDA tests
      # (against float64, the self-diagonal and far-row cases, the long sums, the op checks); bench_matmul at 10^6
      # points, the default tensor-core kernel and the three symmetric instances in alternation; memcheck and
      # racecheck over the symmetric kernels; the rest of the K @ V CUDA tests; at most S27A_BUDGET seconds (default
      # 590). Files: gpb.tgz, s27a_logs.tar.gz, s27a_results.tar.gz.
      stage_begin s27a ${S27A_BUDGET:-590} 240
      [ -s .gpb/gpb.tgz ] || pack_build
      cuda_tests "$OUT/s27a_tests.log" 90 tests/test_cuda_kernels.py \
        -k "symmetric or self_diagonal or far_rows or op_checks"
      kvs=(tc tc_sym tc_sym512 tc_sym512b2)
      kv_kernels "$OUT/s27a_bench.log" 90 bench_matmul_s27 1000000 "${kvs[@]}" "${kvs[@]}"
      sanitizer memcheck "$OUT/s27a_sanitize.log" 40 --only kvsym
      sanitizer racecheck "$OUT/s27a_sanitize.log" 90 --only kvsym
      cuda_tests "$OUT/s27a_kv_tests.log" 100 tests/test_cuda_kernels.py -k "matmul"
      pack_logs s27a
      stage_end s27a ;;
    *) echo "unknown stage $st"; exit 2 ;;
  esac
done
log done
