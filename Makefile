# make demo   - the demo models (an MLP; a transformer encoder on variable-length inputs;
#               a decoder, generating): export, load, run, timing; then a short pxrt bench
# make test   - make lint, then the tests: every module on 4 virtual devices; those that
#               depend on it on 1 device with the pure-Python handlers; Ray Serve once
# make bench  - the micro-benchmarks (pytest-benchmark) and the side-by-side comparisons
# make soak   - pxrt serve for 5 minutes under mixed good and bad traffic and reloads:
#               leaks, 5xx
# make debug  - rebuild the extensions with bounds checks, line tracing and annotation
# make lint   - ruff; mypy over pxrt/ and serving/; stubtest: the Cython modules' .pyi
#               stubs against the built modules; the documentation site, built strictly
# make docs   - the documentation site (mkdocs) on localhost:8001
# Each target creates .venv and installs pxrt (editable, with its test and bench extras)
# when needed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pxrt-installed
# The tests compile with LLVM's lowest optimization level: the same HLO through the same
# XLA passes (the same numbers: XLA does not let LLVM reorder float math), in about half
# the compile time, which is most of a decoder test's (17 programs: 17 s against 9.7 s);
# and with XLA:CPU's older loop emitters for fusions instead of its MLIR fusion emitters
# (the same fused HLO, emitted element by element): the test decoder's 32 programs in 12
# s of CPU against 30 (docs/development.md). Benchmarks and `pxrt serve` keep the default.
TEST_XLA := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
FOUR := XLA_FLAGS=--xla_force_host_platform_device_count=4
TEST_ONE := XLA_FLAGS="$(TEST_XLA)"
TEST_FOUR := XLA_FLAGS="$(TEST_XLA) --xla_force_host_platform_device_count=4"

.PHONY: all demo test bench soak debug lint docs clean

all: $(STAMP) $(MLSERVER)

# keras-hub for tests/test_keras_hub.py, without its tensorflow-text (which pulls
# TensorFlow, 600 MB): backbones and causal LMs on the JAX backend do not need it (its
# tokenizers do; users who have keras-hub have them). `pip install 'pxrt[keras-hub]'`
# is the whole of it.
KERAS_DEPS := 'keras>=3.15' 'kagglehub!=1.0.1' 'kagglesdk==0.1.28' regex rich
KERAS_HUB := 'keras-hub==0.32.0'

# uv installs the same packages as pip in under half the time (pip if uv cannot be had).
# --compile-bytecode: uv (unlike pip) writes no .pyc by default, and where
# PYTHONDONTWRITEBYTECODE is set no process writes them, so every test process and every
# server a test starts compiled jax, Ray and the rest from source (Ray's module took 2x).
EXTRAS := .[test,bench,docs,grpc,ray]

$(STAMP): pyproject.toml setup.py $(wildcard pxrt/*.pyx pxrt/*.pxd serving/*/*.pyx serving/*/*.pxd)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e '$(EXTRAS)' \
		|| $(PY) -m pip install -q -e '$(EXTRAS)'
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(KERAS_DEPS) \
		&& $(VENV)/bin/uv pip install -q --compile-bytecode --no-deps --python $(PY) $(KERAS_HUB) \
		|| ($(PY) -m pip install -q $(KERAS_DEPS) && $(PY) -m pip install -q --no-deps $(KERAS_HUB))
	touch $@

# MLServer (the `mlserver` extra) cannot share .venv with KServe (pyproject.toml says why):
# tests/test_integrations.py starts `mlserver` from a venv of its own holding pxrt's
# dependencies and the extra's, with this tree on its PYTHONPATH (its extensions are
# built for the same Python). No --compile-bytecode: 2 s instead of 30, and the one
# server the test starts compiles only what it imports.
MLSERVER_VENV := .venv-mlserver
MLSERVER := $(MLSERVER_VENV)/.pxrt-installed

$(MLSERVER): pyproject.toml $(STAMP)
	$(VENV)/bin/uv venv -q --allow-existing --python $(PY) $(MLSERVER_VENV)
	$(VENV)/bin/uv pip install -q --python $(MLSERVER_VENV)/bin/python \
		-r pyproject.toml --extra mlserver
	touch $@

demo: $(STAMP)
	$(VENV)/bin/pxrt demo
	$(VENV)/bin/pxrt demo encoder
	$(VENV)/bin/pxrt demo lm
	$(VENV)/bin/pxrt bench --quick

# One pass runs every module but the gRPC and Ray ones (4 virtual devices, the Cython
# build). tritonclient.grpc and kserve register the same protobuf names, so the gRPC
# tests run in a pytest of their own, on one device, with Ray Serve's two modules beside
# them (they mostly wait on Ray's own processes; each starts its own local Ray) and the
# wheel's (a build, a fresh venv, pxrt demo and pxrt serve from it). The modules marked `devices` (how batches
# split over the devices) or `twins` (the Cython modules end to end) run again on one
# device with the pure-Python twins, less their tests marked `once` (they depend on
# neither). Two pytest workers share the cores, a module each at a time (a third gained
# nothing: 429 s against 437 s for the first step); every step shares one compilation
# cache, so a program is compiled once per device count, not once per process. The first
# pass keeps the cores busy; the gRPC pass mostly waits on Ray, so the pure-Python pass
# and `make lint` run beside it (their output follows it).
# --durations: the slowest tests of each run.
PYTEST := $(PY) -m pytest -q --durations=30
XDIST := -n 2 --dist loadfile
GRPC := tests/test_grpc.py tests/test_grpc_native.py tests/test_grpc_generate.py \
	tests/test_shared_memory.py tests/test_ray.py tests/test_serve_ray.py tests/test_wheel.py
SUITE := tests $(addprefix --ignore=,$(GRPC))

test: $(STAMP) $(MLSERVER)
	$(PY) -m compileall -q -j 0 pxrt serving tests  # (the same, for this tree's own modules)
	export PXRT_CACHE_DIR=$$(mktemp -d -t pxrt-test-cache-XXXXXX); logs=$$(mktemp -d); \
	$(TEST_FOUR) $(PYTEST) $(XDIST) $(SUITE); status=$$?; \
	if [ $$status -eq 0 ]; then \
		$(MAKE) -s lint > $$logs/lint 2>&1 & lint=$$!; \
		$(TEST_ONE) PXRT_NO_EXTENSIONS=1 $(PYTEST) $(XDIST) -m "(devices or twins) and not once" \
			$(SUITE) > $$logs/twins 2>&1 & twins=$$!; \
		$(TEST_ONE) $(PYTEST) $(XDIST) $(GRPC); status=$$?; \
		wait $$twins || status=1; echo "--- pure-Python pass:"; cat $$logs/twins; \
		wait $$lint || status=1; echo "--- make lint:"; cat $$logs/lint; \
	fi; \
	rm -rf "$$PXRT_CACHE_DIR" $$logs; exit $$status

bench: $(STAMP)
	$(PY) -m pytest -q benchmarks --benchmark-columns=min,median,mean,ops --benchmark-sort=name
	$(FOUR) $(PY) -m pytest -q benchmarks --benchmark-columns=min,median,mean,ops --benchmark-sort=name
	$(PY) benchmarks/compare.py
	$(FOUR) $(PY) benchmarks/compare.py
	$(PY) benchmarks/serving_overhead.py
	$(PY) benchmarks/http_compare.py
	$(PY) benchmarks/protocol_overhead.py
	$(PY) benchmarks/health_under_load.py
	$(PY) benchmarks/grpc_compare.py
	$(PY) benchmarks/variable_length.py
	$(PY) benchmarks/generation.py
	$(PY) benchmarks/ray_compare.py
	$(PY) benchmarks/ray_compare.py --model encoder
	$(PY) benchmarks/load_times.py --ray
	$(FOUR) $(PY) benchmarks/placement.py
	$(PY) benchmarks/multihost.py

soak: $(STAMP)
	$(PY) benchmarks/soak.py

debug: $(STAMP)
	$(PY) -m pip install -q 'cython>=3.0.11' 'setuptools>=77'
	PXRT_DEBUG=1 $(PY) setup.py build_ext --inplace --force

STUBS := pxrt._batch pxrt._handlers pxrt._keys pxrt._slots serving.kserve._tensors serving.grpc._hpack \
	serving.kserve._shmguard

# The documentation site is built strictly (a broken link or reference fails) into a
# throwaway folder (not --quiet: mkdocs then drops the warnings that --strict counts);
# `make docs` serves it, rebuilt on every change.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

# mypy and stubtest run side by side, each with a cache of its own (stubtest ignores
# MYPY_CACHE_DIR and writes .mypy_cache): sharing one, mypy crashed in typeshed's
# zipimport.pyi when both started cold.
lint: $(STAMP)
	$(VENV)/bin/ruff check pxrt serving tests benchmarks setup.py docs/hooks.py
	$(VENV)/bin/mypy --cache-dir .mypy_cache/lint & mypy=$$!; \
	site=$$(mktemp -d); $(MKDOCS) build --strict -d $$site/html > $$site/log 2>&1 & docs=$$!; \
	$(PY) -m mypy.stubtest --ignore-disjoint-bases --mypy-config-file pyproject.toml \
		--allowlist tests/stubtest_allowlist.txt \
		$(STUBS); stubs=$$?; wait $$docs; built=$$?; \
	if [ $$built -ne 0 ]; then grep -v "^INFO" $$site/log; fi; rm -rf $$site; \
	wait $$mypy && [ $$built -eq 0 ] && exit $$stubs

docs: $(STAMP)
	$(MKDOCS) serve -a localhost:8001

clean:
	rm -rf build site pxrt/*.so pxrt/*.c pxrt/*.html serving/*/*.so serving/*/*.c serving/*/*.html $(VENV) $(MLSERVER_VENV)
