# Sourced by the device scripts (device_run.sh, device_run_41.sh): install nmcompile in place (its
# torch.compile backend is found through the package's entry point) and write what the machine has
# (GPU, host cores, torch, CUDA, cuSPARSELt, the backends found, nmcompile's commit) to $OUT/env.txt.
device_env() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    nproc
    git rev-parse --short HEAD 2>/dev/null
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
    python3 - <<'PY'
import importlib.metadata as md, torch
import nmcompile
eps = [e.name for e in md.entry_points(group="torch_dynamo_backends")]
print("torch", torch.__version__, "cuda", torch.version.cuda, "cusparselt",
      torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None,
      "capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
      "backends", eps, "nmcompile", nmcompile.__file__)
PY
  } 2>&1 | tee "$OUT/env.txt"
}
