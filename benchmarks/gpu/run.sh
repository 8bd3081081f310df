#!/usr/bin/env bash
# On one CUDA GPU (prepared for an H200, under 8 minutes): the GPU-marked and Triton tests on the device, then the kernel
# benchmarks and the engine's decode rate, written as markdown under $OUT (default ./gpu-out).
#   OUT=/some/dir benchmarks/gpu/run.sh            (CPU: DRY_RUN=1 benchmarks/gpu/run.sh runs the same steps, tiny shapes)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = "1" ]; then
  export TRITON_INTERPRET=1
  DRY=--dry-run
else
  DRY=
  "$PY" -c "import torch, triton, fla; assert torch.cuda.is_available(), 'no CUDA device'" || { echo "run.sh: needs CUDA, triton and fla (pip install 'openk3[gpu]')" >&2; exit 2; }
fi
# tests first: a kernel whose test fails is not timed (the driver also checks each kernel against its baseline)
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_triton_mxfp4.py tests/ops/test_triton_mla.py tests/ops/test_kda_fla.py \
  tests/serve/test_sync_decode.py tests/serve/test_decode_graphs.py 2>&1 | tee "$OUT/tests.txt"
timeout 300 "$PY" benchmarks/gpu/driver.py $DRY --out "$OUT"
