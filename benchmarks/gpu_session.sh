#!/usr/bin/env bash
# Issue 21's measurements on the GPU machine (the `device` tool), one phase per `run` call, each under 10 minutes:
#   <install line of ../shared/gpu/prepare.sh>; bash benchmarks/gpu_session.sh tests|loops|main|mission
# (carry .device). Logs, tables and the MLflow store go under $OUT; docs/gpu.md says what each phase checks.
#   tests    python -m pytest -m gpu: graphed = eager, no host sync in a graphed step, resume bitwise, MPS sharing
#   loops    benchmarks/train_loops.py --device cuda at the issue's four shapes: plain, MONAI, medsweep eager/graphed
#   main     the main command (densenet121, amp=true,false), its start-up and the report's amp verdict
#   mission  the 12-job sweep, 4 jobs at a time on the one GPU (gpu_share=auto), its wall time and report
set -euo pipefail
phase=${1:-}
[[ $phase =~ ^(tests|loops|main|mission)$ ]] || { echo "error: phase '$phase': tests, loops, main or mission" >&2; exit 2; }
out=${OUT:?the device tool sets OUT}
store=(mlflow.tracking_uri="sqlite:///$out/mlflow.db")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt"
python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())' >>"$out/gpu.txt"
git rev-parse --short HEAD >>"$out/gpu.txt" 2>/dev/null || true
timed() {  # name, command...: its output and wall seconds under $OUT
  local name=$1 start=$SECONDS
  shift
  "$@" >"$out/$name.txt" 2>&1 || echo "exit $?" >>"$out/$name.txt"
  echo "$name: $((SECONDS - start)) s wall" | tee -a "$out/wall.txt"
}
case $phase in
tests) timed gpu_tests python -m pytest -m gpu -q -p no:cacheprovider tests ;;
loops)
  for shape in "densenet121 28 32 30" "resnet18 28 32 30" "resnet18 64 16 60" "densenet121 64 16 60"; do
    read -r model size batch steps <<<"$shape"
    timed "loops_${model}_$size" python benchmarks/train_loops.py --device cuda --model "$model" --size "$size" \
      --batch "$batch" --steps "$steps" --warmup 5 --repeats 3
  done
  ;;
main)
  timed main python -m src.train -m model=densenet121 amp=true,false "${store[@]}" hydra.sweep.dir="$out/sweep_main"
  timed main_report python -m src.report sweep="$out/sweep_main"
  ;;
mission)
  timed mission python -m src.train -m model=densenet121,resnet18 amp=true,false seed=0,1,2 hydra/launcher=joblib \
    hydra.launcher.n_jobs=4 "${store[@]}" hydra.sweep.dir="$out/sweep_mission"
  timed mission_report python -m src.report sweep="$out/sweep_mission"
  ;;
esac
