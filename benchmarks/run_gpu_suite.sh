#!/usr/bin/env bash
# Run the recorded GPU benchmarks into one folder, a log per step, and pack them after every step:
#   bash benchmarks/run_gpu_suite.sh OUT_DIR [step ...]
# Steps: doctor ladder ablation compile matmul top peers amp loaders profiling corpus grading reliability notebooks ddp
# coldstart samples quick (default: all but ddp, which needs a machine with several GPUs, coldstart, which takes most
# of 10 minutes, samples, which builds this machine's compile-cache artifact, and quick, every command and notebook
# in quick mode). corpus's folder is what benchmarks/results/diagnosis/trace_corpus/ holds.
# The pack (OUT_DIR.tar.gz) is rewritten after each step, so an interrupted run keeps what finished.
set -u
out=${1:?usage: run_gpu_suite.sh OUT_DIR [step ...]}
shift
steps=${*:-doctor ladder ablation compile matmul peers amp loaders profiling corpus grading reliability notebooks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - start))s"
  tail -n "${TAIL:-15}" "$out/$name.log"
  tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
}
for s in $steps; do
  case $s in
    doctor) run doctor 120 python -m labkit doctor --json "$out/doctor.json" ;;
    ladder) run ladder "${LADDER_LIMIT:-420}" python benchmarks/ladder.py --epochs "${EPOCHS:-4}" --out "$out" ;;
    ablation) run ablation "${ABLATION_LIMIT:-590}" python benchmarks/ladder.py --ablation --epochs "${EPOCHS:-4}" \
                --repeats "${ABLATION_REPEATS:-2}" --out "$out" ;;
    compile) run compile 420 python benchmarks/compile_time.py --out "$out" ;;
    matmul) run matmul 180 python benchmarks/week2_matmul.py --out "$out"
            run waves 180 python benchmarks/week2_matmul.py --waves --out "$out" ;;
    top) run top "${TOP_LIMIT:-420}" python benchmarks/top_rung.py --out "$out" ${TOP_ARGS:-} ;;
    peers) run peers 300 python benchmarks/peers.py --epochs 3 --out "$out" ;;
    amp) run amp 240 python benchmarks/week3_amp.py --out "$out" ;;
    loaders) run loaders 300 python benchmarks/week4_loaders.py --out "$out"
             run overlap 120 python benchmarks/week4_loaders.py --overlap --out "$out" ;;
    profiling) run profiling 300 python benchmarks/week5_profiling.py --out "$out" --trace-out "$out/gpu_trace.json.gz" ;;
    corpus) run corpus 590 python benchmarks/trace_corpus.py --out "$out/trace_corpus" ;;
    grading) run grading 300 python benchmarks/grade_reference_gpu.py --out "$out" ;;
    reliability) run reliability "${RELIABILITY_LIMIT:-300}" python benchmarks/grade_reliability.py --out "$out" ;;
    ddp) run ddp "${DDP_LIMIT:-580}" python benchmarks/ddp_scaling.py --out "$out" ${DDP_ARGS:-} ;;
    coldstart) run coldstart "${COLD_LIMIT:-590}" python benchmarks/cold_start.py --out "$out" ${COLD_ARGS:-} ;;
    samples) pyc=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$(mktemp -d)")  # the build fills it: torch's
             run artifact 300 "${pyc[@]}" python -m labkit compile-cache --build --rungs muon  # bytecode as installed
             for c in muon batch_fused; do  # then fresh compile caches, as on a new machine with the artifact
               run "samples_$c" 180 "${pyc[@]}" TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" TRITON_CACHE_DIR="$(mktemp -d)" \
                 python benchmarks/stack_samples.py --name "stack_samples_$c" --out "$out" -- train --preset "$c"
             done ;;
    quick) run quick 590 python benchmarks/gpu_quick.py --out "$out/quick" ;;
    notebooks) run notebooks 590 python benchmarks/run_notebooks.py --bundle "$out/notebook_runs.tar.gz" ;;
    *) echo "unknown step $s" ;;
  esac
done
