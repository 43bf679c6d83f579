#!/usr/bin/env bash
# One GPU check, time-boxed, for a machine lent for minutes: the 1B Llama FSDP step (ours, torch's
# fully_shard, plain torch), dispatch on CUDA, then the whole suite with its tensors on the GPU
# (DTL_TEST_DEVICE=cuda: every rank on the one GPU, gloo moving CUDA tensors through the host).
#   benchmarks/gpu_check.sh [OUT_DIR] [SECONDS]      (needs pytest-xdist; defaults: gpu_out, 530)
# Writes env.log, gpu_step.{log,json}, dispatch.{log,json}, tests.log and failures.log (each
# failure's traceback as it is reported, so a run cut off by its time limit still says why).
set -u
OUT=${1:-gpu_out}; BUDGET=${2:-530}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/env.log"
timeout 170 python3 benchmarks/gpu_step.py --ac none full --steps 5 --warmup 2 --json "$OUT/gpu_step.json" > "$OUT/gpu_step.log" 2>&1
echo "gpu_step rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a "$OUT/env.log"
timeout 60 python3 benchmarks/dispatch.py --device cuda --iters 4000 --json "$OUT/dispatch.json" > "$OUT/dispatch.log" 2>&1
echo "dispatch rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a "$OUT/env.log"
cat > "$OUT/failtrace.py" <<PY
import os
def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.path.join("$OUT", "failures.log"), "a") as f:
            f.write(f"==== {report.nodeid} [{report.when}]\n{report.longreprtext[-5000:]}\n")
PY
DTL_TEST_DEVICE=cuda PYTHONPATH=$PWD:$OUT timeout $(( BUDGET - ($(date +%s) - T0) )) \
  python3 -m pytest -p no:cacheprovider -p failtrace -n 6 -v -rfE tests > "$OUT/tests.log" 2>&1
echo "tests rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a "$OUT/env.log"
tail -8 "$OUT/gpu_step.log"; tail -3 "$OUT/tests.log"
