#!/usr/bin/env bash
# Downloads into .whl/ (repo root, git-ignored through .git/info/exclude) the wheels benchmarks/gpu/run.sh needs on a GPU
# machine with no network whose image has Python 3.12, torch 2.11, triton 3.6, transformers, numpy, einops, packaging,
# pytest & co. but not fla. Carry .whl to that machine; run.sh installs what it finds there.
#   benchmarks/gpu/wheels.sh            (needs PyPI; prints the total size, which travels within the 64 MiB tree limit)
# Only what run.sh's tests and driver import and the image lacks: openk3's other runtime dependencies (fastapi, uvicorn,
# pydantic, zstandard, xgrammar) are not imported on that path. fla-core 0.6.0 needs torch>=2.7, triton>=3.3 and einops.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(fla-core==0.6.0 einops==0.8.2)  # einops: fla's one requirement; the image has it, a dev venv may not
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl  # one version per package: a stale wheel beside a new one stops the install there
timeout 300 python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
echo "total: $(du -sh .whl | cut -f1) in .whl (carry it: run tool's carry=[\".whl\"])"
