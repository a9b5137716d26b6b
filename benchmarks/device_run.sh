#!/bin/bash
# One call on a lent GPU machine (the device tool): install nmcompile in place (its torch.compile
# backend is found through the package's entry point), say what the machine has, then run
# gpu_check.py with every log under $OUT. Arguments go to gpu_check.py.
#     bash benchmarks/device_run.sh --budget-s 420 --tests-s 120
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  nproc
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
  python3 - <<'PY'
import importlib.metadata as md, torch
import nmcompile
eps = [e.name for e in md.entry_points(group="torch_dynamo_backends")]
print("torch", torch.__version__, "cuda", torch.version.cuda, "cusparselt",
      torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None,
      "capability", torch.cuda.get_device_capability(), "backends", eps, "nmcompile", nmcompile.__file__)
PY
} 2>&1 | tee "$OUT/env.txt"
python3 benchmarks/gpu_check.py --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
