#!/usr/bin/env bash
# On one CUDA GPU (prepared for an H100/H200, under 8 minutes): the GPU-marked and Triton tests on the device, then the
# kernel benchmarks and the engine's decode rate, written as markdown under $OUT (default ./gpu-out).
#   OUT=/some/dir benchmarks/gpu/run.sh            (CPU: DRY_RUN=1 benchmarks/gpu/run.sh runs the same steps, tiny shapes)
#   OPENK3_COMMIT=<sha> names the commit in the results where the tree travelled without .git
# A machine with no network gets fla as wheels: benchmarks/gpu/wheels.sh fills .whl/ here, and this script installs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
# the dev venv where there is one; a GPU image's python3 already holds torch and triton
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1  # so that what a step printed before its timeout killed it is in its log
# openk3 is not installed on a bare image: import it (and tests/, for the driver run as a script) from this checkout
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then  # into a side folder: --no-deps, so the image's torch and triton stay as they are
  site=${WHEEL_SITE:-/tmp/openk3-wheels}
  timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
fi
if [ "${DRY_RUN:-0}" = "1" ]; then
  export TRITON_INTERPRET=1
  DRY=--dry-run
else
  DRY=
  "$PY" -c "import torch, triton, fla; assert torch.cuda.is_available(), 'no CUDA device'" || { echo "run.sh: needs CUDA, triton and fla (pip install 'openk3[gpu]', or benchmarks/gpu/wheels.sh)" >&2; exit 2; }
fi
"$PY" -c "import importlib.metadata as m, sys, torch, triton
fla = [d.version for d in m.distributions() if d.metadata['Name'] == 'fla-core']
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'fla-core', fla[:1] or None)" | tee "$OUT/env.txt"
# one run on a lent machine: a failing test does not stop the driver (each of its rows checks its kernel before timing),
# but it fails the script and heads the table, so no ratio is read as a claim while a test fails
tests=0
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_triton_mxfp4.py tests/ops/test_triton_mla.py tests/ops/test_triton_mla_prefill.py \
  tests/ops/test_kda_fla.py tests/serve/test_sync_decode.py tests/serve/test_decode_graphs.py 2>&1 | tee "$OUT/tests.txt" || tests=$?
driver=0
timeout 300 "$PY" benchmarks/gpu/driver.py $DRY --out "$OUT" 2>&1 | tee "$OUT/driver.txt" || driver=$?
if [ "$tests" != 0 ] && [ -f "$OUT/gpu.md" ]; then
  sed -i "1i **Tests failed (exit $tests, see tests.txt): the ratios below are not claims.**\n" "$OUT/gpu.md"
fi
exit $((tests ? tests : driver))
