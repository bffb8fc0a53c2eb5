PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: run test test-heavy test-py312 gpu-compile gpu-compile-mosaic bench lint install install-test

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(VENV)/bin/activate
	$(PIP) install -q -e .

install-test: $(VENV)/bin/activate
	$(PIP) install -q -e '.[test]'

run: install
	$(VENV)/bin/kimi-linear-jax generate --output-format text --max-tokens 96 --repetition-penalty 1.2 \
		--prompt "$$(printf 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        self')"

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# One worker per core, each test file on one worker (its module fixtures compile once): the
# suite is compile-bound, and two workers took it from 15.9 to 9.5 min on the 2-core machine.
# Files in collection order (tests/conftest.py puts the longest first), not xdist's default of
# the most tests first, so no long file starts last and runs alone.
test: lint
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

# The heavy tests (marked `heavy`): the longest tests of features the default run covers
# elsewhere, kept out of `make test`'s 15-minute budget; CI runs them after it.
test-heavy: install-test
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder -m heavy

bench: install-test
	$(PY) -m benchmarks all

# The newest jax that pip picks on Python 3.12 (0.12.x today): the kernel and parallel tests,
# so that a jax release cannot break them silently. Without a Python 3.12 it says so and passes.
VENV312 := .venv312
FIND_PY312 := for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	if "$$p" -c "" 2>/dev/null; then echo "$$p"; break; fi; done

test-py312:
	@PY312=$$($(FIND_PY312)); \
	if [ -z "$$PY312" ]; then echo "test-py312 SKIPPED: no Python 3.12 found"; exit 0; fi; \
	set -e; \
	[ -x $(VENV312)/bin/python ] || "$$PY312" -m venv $(VENV312); \
	$(VENV312)/bin/python -m pip install -q --upgrade pip; \
	$(VENV312)/bin/python -m pip install -q -e . pytest hypothesis httpx; \
	$(VENV312)/bin/python -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__)"; \
	$(VENV312)/bin/python -m pytest -q -m "not slow and not gpu and not deviceless" tests/kernels tests/parallel tests/model/test_mla_moe.py; \
	$(VENV312)/bin/python -m pytest -q -m "not slow and not gpu and not deviceless" tests/serving/test_speculative.py -k "bfloat16 or track_points"; \
	$(VENV312)/bin/python -m pytest -q -m "not slow and not gpu and not deviceless and not heavy" tests/serving/test_cuda_lowering.py


# The GPU build proven without a GPU: every MLA kernel launch and every engine step compiled
# deviceless for an H200 (kernels/gpu_target.py), in a venv of its own with the CUDA plugin at
# the installed jax's version: jax[cuda12-local] lets pip pick the newest jax whose plugin is
# published (jax 0.12.1 came out before its plugin did). Fails on a failed compile or a spill
# in the kernel; the report goes to out/gpu_compile/gpu_compile.json (benchmarks/RESULTS.md,
# "Deviceless H200 compile").
VENVCUDA := .venv-cuda
gpu-compile:
	@set -e; \
	[ -x $(VENVCUDA)/bin/python ] || $(PYTHON) -m venv $(VENVCUDA); \
	$(VENVCUDA)/bin/python -m pip install -q --upgrade pip; \
	$(VENVCUDA)/bin/python -m pip install -q -e '.[gpu-compile]' 'jax[cuda12-local]'; \
	$(VENVCUDA)/bin/python -c "import jax; print('jax', jax.__version__, 'for the CUDA plugin')"; \
	JAX_PLATFORMS=cpu $(VENVCUDA)/bin/python -m pytest -q -m deviceless tests/kernels/test_deviceless.py tests/serving/test_target_plan.py; \
	JAX_PLATFORMS=cpu $(VENVCUDA)/bin/python benchmarks/gpu_compile.py --out out/gpu_compile

# The Mosaic GPU kernel (kernels/mla_decode_mgpu.py) needs jax >= 0.12: the newest jax on
# Python 3.12 with its CUDA plugin, compiled deviceless for the H200 (fails on a failed compile
# or a spill; out/gpu_compile/mosaic_compile.json). Without a Python 3.12 it says so and passes.
VENVCUDA312 := .venv-cuda312
gpu-compile-mosaic:
	@PY312=$$($(FIND_PY312)); \
	if [ -z "$$PY312" ]; then echo "gpu-compile-mosaic SKIPPED: no Python 3.12 found"; exit 0; fi; \
	set -e; \
	[ -x $(VENVCUDA312)/bin/python ] || "$$PY312" -m venv $(VENVCUDA312); \
	$(VENVCUDA312)/bin/python -m pip install -q --upgrade pip; \
	$(VENVCUDA312)/bin/python -m pip install -q -e '.[gpu-compile]' 'jax[cuda12-local]'; \
	$(VENVCUDA312)/bin/python -c "import jax; print('jax', jax.__version__, 'for the CUDA plugin')"; \
	JAX_PLATFORMS=cpu $(VENVCUDA312)/bin/python benchmarks/mosaic_compile.py --out out/gpu_compile
