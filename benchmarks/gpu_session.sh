#!/usr/bin/env bash
# Issue 21's measurements on the GPU machine (the `device` tool), as few calls as its 15 minutes allow:
#   <install line of ../shared/gpu/prepare.sh>; bash benchmarks/gpu_session.sh all          (carry .device)
#   bash benchmarks/gpu_session.sh tests main   # or any phases, in the order given
# Phases (docs/gpu.md says what each checks), each under a time cap, `all` in this order (the issue's "must show"
# first: the caps add up to more than one call's budget, so what is skipped goes to a second call):
#   tests    python -m pytest -m gpu: graphed = eager, no host sync in a graphed step, resume bitwise, MPS sharing
#   main     the main command (densenet121, amp=true,false) and its report's amp verdict
#   mission  the 12-job sweep, 4 jobs at a time on the one GPU (gpu_share=auto): wall time; its first 4 jobs are
#            fresh processes for models `main` probed, so their time/startup_s is the start-up target's figure
#   share    benchmarks/gpu_share.py: 1 and 4 processes training resnet18 28^3 b32 on the GPU, MPS as a sweep uses it
#   loops    benchmarks/train_loops.py --device cuda at the issue's four shapes: plain, MONAI, medsweep eager/graphed
#   startup  (not in all; after main) one job in a fresh process for the model `main` probed, logged to main's store
#            (experiment `startup`): time/startup_s alone
# A phase is skipped once less than its floor is left of GPU_SESSION_BUDGET_S (default 540). Everything goes to
# $GPU_SESSION_DIR (default /tmp/gpu_session); $OUT gets targets.md (benchmarks/gpu_targets.py), wall.tsv and
# gpu_results.tar.gz (logs, JSON, stores and reports; no weights; refreshed after each phase, so a call cut short brings
# back what it measured: `python -m benchmarks.gpu_targets <unpacked folder>` reads it anywhere).
# GPU_SESSION_OVERRIDES (space separated) go to every medsweep command: `device=cpu epochs=1 limit_batches=2` checks
# the script's plumbing on a CPU (tests/test_gpu_benchmarks.py).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?the device tool sets OUT}
dir=${GPU_SESSION_DIR:-/tmp/gpu_session}
budget=${GPU_SESSION_BUDGET_S:-540}
python=${PYTHON:-python3}
declare -A cap=([tests]=150 [loops]=200 [main]=180 [share]=110 [mission]=240 [startup]=90)
declare -A floor=([tests]=60 [loops]=90 [main]=100 [share]=60 [mission]=90 [startup]=45)
read -ra extra <<<"${GPU_SESSION_OVERRIDES:-}"
# the gpu-marked tests, those of the CUDA graph first (pytest's own order put them last, behind the sweeps'):
# only these files are collected (the whole suite's collection imports every test module)
gpu_tests=(tests/training/test_cuda.py tests/test_benchmark_loops.py tests/parallel/test_mps.py
  tests/parallel/test_machine_share.py)
phases=("$@")
[ "${phases[*]:-}" = all ] && phases=(tests main mission share loops)
[ ${#phases[@]} -gt 0 ] || { echo "error: no phase: all, or some of tests loops main share mission startup" >&2; exit 2; }
for phase in "${phases[@]}"; do
  [ -n "${cap[$phase]:-}" ] || { echo "error: phase '$phase': tests, loops, main, share, mission, startup or all" >&2; exit 2; }
done
mkdir -p "$dir"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $python -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())'
  $python -c 'import numpy, pandas; print("numpy", numpy.__version__, "pandas", pandas.__version__)'  # pandas>=3: the report
  echo "commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  date -u +%FT%TZ
} >"$dir/machine.txt" 2>&1
cat "$dir/machine.txt"
started=$SECONDS
timed() {  # name, command...: under the phase's cap and what is left of the budget; output and wall seconds
  local name=$1 left=$((budget - (SECONDS - started))) start=$SECONDS status
  shift
  local limit=$((left < cap[$phase] ? left : cap[$phase]))
  if [ "$limit" -lt "${floor[$phase]}" ]; then
    echo "$name: skipped, ${left} s of the budget left" | tee -a "$dir/skipped.txt"
    return
  fi
  timeout -k 10 "$limit" "$@" >"$dir/$name.log" 2>&1
  status=$?
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - start)) "$status" >>"$dir/wall.tsv"
  echo "$name: $((SECONDS - start)) s wall, exit $status$([ $status -eq 124 ] && echo " (cut at $limit s)")"
}
bundle() {  # the folder into $OUT, after each phase: a call cut short still brings back what it measured
  cp "$dir/wall.tsv" "$out/" 2>/dev/null
  tar -czf "$out/gpu_results.tar.gz" -C "$dir" --exclude='*.pt' --exclude='*.pth' --exclude='.mps' .
  [ "$(stat -c %s "$out/gpu_results.tar.gz")" -le $((16 << 20)) ] ||  # the tool brings back files of 16 MiB at most
    tar -czf "$out/gpu_results.tar.gz" -C "$dir" --exclude='*.pt' --exclude='*.pth' --exclude='.mps' --exclude=mlartifacts .
}
sweep() {  # phase, overrides...: a medsweep sweep into the phase's own store and folder, then its report
  local name=$1
  shift
  timed "$name" $python -m src.train -m "$@" "${extra[@]}" mlflow.tracking_uri="sqlite:///$dir/$name/mlflow.db" \
    hydra.sweep.dir="$dir/$name/sweep"
  [ -d "$dir/$name/sweep" ] && $python -m src.report sweep="$dir/$name/sweep" out="$dir/$name/report" \
    >"$dir/${name}_report.log" 2>&1
}
for phase in "${phases[@]}"; do
  mkdir -p "$dir/$phase"
  case $phase in
  tests)  # the graph's tests first, each named as it ends (-v): a run cut at the cap still says what passed
    timed tests $python -m pytest -m gpu -v -p no:cacheprovider --durations=0 "${gpu_tests[@]}" ;;
  loops)
    for shape in "densenet121 28 32 20" "resnet18 28 32 30" "resnet18 64 16 40" "densenet121 64 16 30"; do
      read -r model size batch steps <<<"$shape"
      timed "loops_${model}_$size" $python benchmarks/train_loops.py --device cuda --model "$model" --size "$size" \
        --batch "$batch" --steps "$steps" --warmup 5 --repeats 3 --json "$dir/loops.jsonl"
    done
    ;;
  main) sweep main model=densenet121 amp=true,false ;;
  share) timed share $python -m benchmarks.gpu_share --device cuda --jobs 1,4 --json "$dir/share.jsonl" ;;
  mission)
    sweep mission model=densenet121,resnet18 amp=true,false seed=0,1,2 hydra/launcher=joblib hydra.launcher.n_jobs=4
    ;;
  startup)
    mkdir -p "$dir/main"
    timed startup $python -m src.train model=densenet121 amp=true seed=1 "${extra[@]}" mlflow.experiment=startup \
      mlflow.tracking_uri="sqlite:///$dir/main/mlflow.db" hydra.run.dir="$dir/startup/run"
    ;;
  esac
  bundle
done
$python -m benchmarks.gpu_targets "$dir" >"$dir/targets.md" 2>&1
cat "$dir/targets.md"
cp "$dir/targets.md" "$out/"
bundle
echo "session: $((SECONDS - started)) s; $(du -h "$out/gpu_results.tar.gz" | cut -f1) in gpu_results.tar.gz"
