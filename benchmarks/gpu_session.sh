#!/usr/bin/env bash
# Issue 21's GPU measurements on a CUDA machine (docs/gpu.md: what to install, what each phase checks):
#   bash benchmarks/gpu_session.sh [--out FOLDER] all
#   bash benchmarks/gpu_session.sh [--out FOLDER] tests main   # or any phases, in the order given
# Phases, each under a time cap (`all` runs the first five in this order):
#   tests    python -m pytest -m gpu: graphed = eager, no host sync in a graphed step, resume bitwise, MPS sharing
#   main     the main command (densenet121, amp=true,false) and its report's amp verdict
#   mission  the 12-job sweep, 4 jobs at a time on the one GPU (gpu_share=auto): wall time; its first 4 jobs are
#            fresh processes for models `main` probed, so their time/startup_s is the start-up target's figure
#   share    benchmarks/gpu_share.py: 1 and 4 processes training resnet18 28^3 b32 on the GPU, MPS as a sweep uses it
#   loops    benchmarks/train_loops.py --device cuda at the issue's four shapes: plain, MONAI, medsweep eager/graphed
#   startup  (not in all; after main, into the same FOLDER) one job in a fresh process for the model `main` probed,
#            logged to main's store (experiment `startup`): time/startup_s alone
# Issue 43's phases (`issue43` runs memory budget startup4 mission, in this order; not in all):
#   memory   benchmarks/memory_table.py --gpu-grid: predicted against measured peak, zoo x 28/64/128^3 x bf16/float32 x
#            batches x graphed/eager, every cell in one process; memory.jsonl, memory.md (ratios, +-15% marked)
#   budget   under mem_budget_mb=24576: the dry run's fits listing at 128^3, then
#            densenet121 at 64^3 and 128^3 (a NIfTI folder of AdrenalMNIST3D resampled) with the memory savers and
#            batch_size=auto: what trains at which batch, samples/s, peak, MFU; each size's report (AMP verdict)
#   startup4 a probing job, then one fresh process alone and 4 joblib workers at once for the probed model:
#            their time/startup_s
# FOLDER (default outputs/gpu_session in the repository, which git ignores) gets everything: machine.txt (GPU, driver,
# torch, commit, date), each command's log, wall.tsv (each phase's wall seconds and exit status; a phase stopped at its
# cap exits 124), loops.jsonl, share.jsonl, each sweep's store and report in its phase's folder, and targets.md
# (`python -m benchmarks.gpu_targets FOLDER`: each target with its measured value, spread and met or missed).
# A phase named twice, or whose folder FOLDER already holds, is refused before anything runs (a sweep into a store that
# holds its jobs would skip them as finished): name another FOLDER, or remove that phase's folder.
# GPU_SESSION_OVERRIDES (space separated) go to every medsweep command: `device=cpu epochs=1 limit_batches=2` checks
# the script's plumbing on a CPU (tests/benchmarks/test_gpu_session.py); PYTHON (default python3) runs every command.
# GPU_SESSION_MEMORY (memory_table.py's arguments, e.g. `--models resnet10 --sizes 28:2`) replaces the memory grid's
# models and sizes, GPU_SESSION_NIFTI (default 192) the volumes of each split in the NIfTI folder, GPU_SESSION_BUDGET
# (overrides) the budget sweeps' switches (then its dry run lists batch 2 only), GPU_SESSION_CAP_FACTOR (default 1)
# multiplies every time cap (a CPU's plumbing is slower): the plumbing test's.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: bash benchmarks/gpu_session.sh [--out FOLDER] all|issue43|PHASE... (tests, main, mission, share, loops,\
 startup, memory, budget, startup4)"
out=$root/outputs/gpu_session
phases=()
while [ $# -gt 0 ]; do
  case $1 in
  --out)
    [ $# -ge 2 ] && [ -n "$2" ] || { echo "error: --out needs a folder" >&2; exit 2; }
    out=$2
    shift 2
    ;;
  --out=?*) out=${1#--out=}; shift ;;
  -h | --help) echo "$usage"; exit 0 ;;
  -*) echo "error: unknown option '$1'; $usage" >&2; exit 2 ;;
  *) phases+=("$1"); shift ;;
  esac
done
dir=$(realpath -m -- "$out")  # a relative FOLDER is the caller's, before the cd below
cd "$root"
python=${PYTHON:-python3}
declare -A cap=([tests]=150 [loops]=200 [main]=180 [share]=110 [mission]=240 [startup]=90 [memory]=210 [budget]=150
  [startup4]=90) named=()
read -ra extra <<<"${GPU_SESSION_OVERRIDES:-}"
read -ra memory_args <<<"${GPU_SESSION_MEMORY:-}"
device=cuda
for override in "${extra[@]}"; do [ "$override" = device=cpu ] && device=cpu; done
budget=mem_budget_mb=24576  # a 24 GiB card's
# the gpu-marked tests, those of the CUDA graph first (pytest's own order put them last, behind the sweeps'):
# only these files are collected (the whole suite's collection imports every test module)
gpu_tests=(tests/training/test_cuda.py tests/benchmarks/test_train_loops.py tests/parallel/test_mps.py
  tests/parallel/test_machine_share.py tests/perf/test_autobatch.py tests/training/test_fused.py)
[ "${phases[*]:-}" = all ] && phases=(tests main mission share loops)
[ "${phases[*]:-}" = issue43 ] && phases=(memory budget startup4 mission)
[ ${#phases[@]} -gt 0 ] || { echo "error: no phase; $usage" >&2; exit 2; }
for phase in "${phases[@]}"; do
  [ -n "${cap[$phase]:-}" ] || {
    echo "error: phase '$phase': tests, loops, main, share, mission, startup, memory, budget, startup4, all or issue43" >&2
    exit 2
  }
  [ -z "${named[$phase]:-}" ] || { echo "error: phase '$phase' named twice" >&2; exit 2; }
  [ ! -e "$dir/$phase" ] || { echo "error: $dir/$phase exists: name another --out, or remove that folder" >&2; exit 2; }
  named[$phase]=1
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
timed() {  # name, command...: under the phase's cap; output and wall seconds
  local name=$1 start=$SECONDS status
  shift
  timeout -k 10 $((cap[$phase] * ${GPU_SESSION_CAP_FACTOR:-1})) "$@" >"$dir/$name.log" 2>&1
  status=$?
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - start)) "$status" >>"$dir/wall.tsv"
  echo "$name: $((SECONDS - start)) s wall, exit $status$([ $status -eq 124 ] && echo " (cut at $((cap[$phase] * ${GPU_SESSION_CAP_FACTOR:-1})) s)")"
}
sweep() {  # phase, overrides...: a medsweep sweep into the phase's own store and folder, then its report
  local name=$1
  shift
  mkdir -p "$dir/$name"
  timed "$name" $python -m src.train -m "$@" "${extra[@]}" mlflow.tracking_uri="sqlite:///$dir/$name/mlflow.db" \
    hydra.sweep.dir="$dir/$name/sweep"
  [ -d "$dir/$name/sweep" ] && $python -m src.report sweep="$dir/$name/sweep" out="$dir/$name/report" \
    >"$dir/${name}_report.log" 2>&1
}
nifti_folder() {  # AdrenalMNIST3D's first volumes of each split as a NIfTI folder, once: the 128^3 cells and jobs
  [ -f "$dir/adrenal_nifti/labels.csv" ] ||
    timed nifti $python benchmarks/nifti_adrenal.py --out "$dir/adrenal_nifti" --per-split "${GPU_SESSION_NIFTI:-192}"
}
nifti128=(data=nifti "data.root=$dir/adrenal_nifti" data.size=128 "data.spacing=[0.5,0.5,0.5]"
  "data.classes=[normal,hyperplasia]")
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
  memory)  # every cell in one process: peak statistics reset, the cache emptied and the graph's pool freed between
    nifti_folder
    timed memory $python -m benchmarks.memory_table --device "$device" --gpu-grid --steps 6 \
      --nifti-root "$dir/adrenal_nifti" --json "$dir/memory.jsonl" --markdown "$dir/memory.md" "${memory_args[@]}"
    ;;
  budget)  # 24 GiB: the dry run's fits listing, then what trains at 64^3 and 128^3 (its gpu tests: the tests phase)
    nifti_folder
    if [ -n "${GPU_SESSION_BUDGET:-}" ]; then  # the plumbing test's: these overrides only, the dry run at batch 2
      read -ra at64 <<<"$GPU_SESSION_BUDGET"
      at128=("${at64[@]}")
      listed=(batch_size=2)
    else
      at64=(amp=true,false model.checkpointing=false,true)
      at128=("${at64[@]}" model.dsconv=false,true)
      listed=(amp=true,false batch_size=4,16,32)
    fi
    timed budget/dry_run $python -m src.train -m model=densenet121 "${nifti128[@]}" "${listed[@]}" "$budget" \
      dry_run=true "${extra[@]}" mlflow.tracking_uri="sqlite:///$dir/budget/mlflow.db" \
      hydra.sweep.dir="$dir/budget/dry_run"
    savers=(model=densenet121 batch_size=auto effective_batch_size=16 "$budget" epochs=1 limit_batches=10)
    sweep budget/64 "${savers[@]}" data.size=64 "${at64[@]}"
    sweep budget/128 "${savers[@]}" "${nifti128[@]}" "${at128[@]}"
    ;;
  startup4)  # the probing job, then fresh processes for the probed model: one alone, then 4 joblib workers at once
    for step in probe alone; do
      timed "startup4/$step" $python -m src.train model=densenet121 amp=true seed=0 skip_finished=false epochs=1 \
        limit_batches=5 "${extra[@]}" mlflow.experiment="startup4_$step" \
        mlflow.tracking_uri="sqlite:///$dir/startup4/mlflow.db" hydra.run.dir="$dir/startup4/$step"
    done
    timed startup4/four $python -m src.train -m model=densenet121 amp=true seed=1,2,3,4 epochs=1 limit_batches=5 \
      hydra/launcher=joblib hydra.launcher.n_jobs=4 "${extra[@]}" mlflow.experiment=startup4_four \
      mlflow.tracking_uri="sqlite:///$dir/startup4/mlflow.db" hydra.sweep.dir="$dir/startup4/four"
    ;;
  startup)
    mkdir -p "$dir/main"
    timed startup $python -m src.train model=densenet121 amp=true seed=1 "${extra[@]}" mlflow.experiment=startup \
      mlflow.tracking_uri="sqlite:///$dir/main/mlflow.db" hydra.run.dir="$dir/startup/run"
    ;;
  esac
done
$python -m benchmarks.gpu_targets "$dir" >"$dir/targets.md" 2>&1
cat "$dir/targets.md"
echo "gpu_session.sh: $((SECONDS - started)) s; everything in $dir"
