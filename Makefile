# `make test` and `make serve` create .venv when missing and install the project into it (idempotent, quick when done).
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed-stamp
FLA_SITE := .venv/fla-site

.PHONY: venv test test-fast lint serve clean system-deps

# torch first, pinned to the CPU wheel this machine carries; the project itself only asks for torch>=2.6 so GPU users keep their build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

# fla-core (fla's KDA kernels) for tests/ops/test_kda_fla_interpreted.py, which runs its real kernels under Triton's
# interpreter in a subprocess. Installed beside the venv, not into it: importable there, it would make transformers'
# kimi_linear (the HF parity oracle) call fla's Triton kernels on CPU tensors, which fails. Pinned: the test checks this
# version's contract (a new pin here reinstalls it); the gpu extra asks for fla-core>=0.6.
$(FLA_SITE)/.stamp: $(STAMP) Makefile
	rm -rf $(FLA_SITE)
	$(PIP) install -q --no-deps --target $(FLA_SITE) fla-core==0.6.0 einops==0.8.2
	touch $@

venv: $(STAMP) $(FLA_SITE)/.stamp

# Debian packages the tests need: bubblewrap (sandbox namespaces), zstd (snapshot export), gcc (the CPU kernels of
# openk3/ops/cpu, built on first use; without a compiler the engine runs the torch ops and their tests skip), libc6-dev
# (the static libc the sandbox's host-side helper openk3-enter links against; gcc only recommends it), binutils (objdump:
# tests/ops/test_portable_kernels.py reads the kernels' instructions; gcc depends on it, named for the check).
# Skipped when not root or already present.
system-deps:
	@if { ! command -v bwrap >/dev/null 2>&1 || ! command -v zstd >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1 || ! command -v objdump >/dev/null 2>&1 || ! dpkg -s libc6-dev >/dev/null 2>&1; } && [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap zstd gcc libc6-dev binutils >/dev/null; fi

test: venv system-deps
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow and not sandbox and not distributed"

# the three checks CI runs before the tests: lint rules, formatting (line length 160, pyproject.toml) and types
lint: venv
	.venv/bin/ruff check openk3 tests benchmarks
	.venv/bin/ruff format --check openk3 tests benchmarks
	.venv/bin/mypy openk3 tests

serve: venv
	.venv/bin/openk3 serve

clean:
	rm -rf .venv build *.egg-info
