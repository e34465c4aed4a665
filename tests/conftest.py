"""Shared fixtures: real models (a tiny random one and the embedded SmolLM2), real engines, live servers."""
import dataclasses
import logging
import threading
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from engine import EngineConfig, LLMEngine

from .torch_jobs import run_job


TESTS = Path(__file__).resolve().parent
# Each folder of tests/ is a group, and its name a marker (registered in setup.cfg): `pytest -m engine` runs one
# group, `make test-fast` the folders unit/ and engine/.
GROUPS = ("unit", "engine", "backends", "server", "responses", "tools", "page", "robustness", "bench", "docs")

# `make test` runs the suite on every core (pytest-xdist, `--dist loadfile --no-loadscope-reorder`): a module runs
# in one worker (its module fixtures, live servers among them, start once), handed out in collection order. The
# longest modules on the 2-core AVX2 host go out early and apart (two of them at once slow each other down: every
# engine computes on every core), so that none is left to end the run alone; the rest go in the order of their file
# names, whatever their folders (module names are unique across tests/).
LONGEST_MODULES = {"test_batch_invariance.py": 0, "test_vllm_parallel.py": 12, "test_soak.py": 24}


def pytest_itemcollected(item):
    group = item.path.parent.name
    if group in GROUPS and item.path.parent.parent == TESTS:
        item.add_marker(group)


def pytest_collection_modifyitems(items):
    modules = sorted(dict.fromkeys(item.path.name for item in items))
    for name, place in LONGEST_MODULES.items():
        if name in modules:
            modules.remove(name)
            modules.insert(min(place, len(modules)), name)
    order = {name: index for index, name in enumerate(modules)}
    items.sort(key=lambda item: order[item.path.name])  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def smol_model_dir() -> str:
    from engine.model_store import resolve_model

    return resolve_model(EngineConfig())  # prepares it in a child process if `make model` has not


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_model_dir) -> str:
    return run_job("build_tiny_model", target=str(tmp_path_factory.mktemp("tiny-llama")), architecture="llama",
                   tokenizer_dir=smol_model_dir)


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory, smol_model_dir) -> str:
    return run_job("build_tiny_model", target=str(tmp_path_factory.mktemp("tiny-opt")), architecture="opt",
                   tokenizer_dir=smol_model_dir)


@pytest.fixture
def make_engine():
    """Start real engines (real forked workers); every one is shut down after the test."""
    engines = []

    def start(model: str, **settings) -> LLMEngine:
        settings.setdefault("dtype", "float32")
        settings.setdefault("threads", 1)
        engine = LLMEngine(EngineConfig(model=model, **settings)).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.shutdown()


class LiveServer:
    """The real app on a real port (werkzeug, threaded), in this process."""

    def __init__(self, app):
        self.app = app
        self.state = app.extensions["lockstep"]
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        # The app checks Host and Origin against its bind address: tell it the real one.
        self.state.settings = dataclasses.replace(self.state.settings, host="127.0.0.1", port=self.server.server_port)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.ws_url = f"ws://127.0.0.1:{self.server.server_port}/ws"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.state.engine.shutdown()


def start_live_server(model: str, settings=None, **engine_settings) -> LiveServer:
    """The app with a real engine for `model` (float32, one thread unless told otherwise), on a real port."""
    from app import create_app

    engine_settings.setdefault("dtype", "float32")
    engine_settings.setdefault("threads", 1)
    config = {"ENGINE": EngineConfig(model=model, **engine_settings), "WAIT_FOR_MODEL": True}
    if settings is not None:
        config["SETTINGS"] = settings
    return LiveServer(create_app(config))


@pytest.fixture
def make_server_for():
    servers = []

    def start(model: str, settings=None, **engine_settings) -> LiveServer:
        servers.append(start_live_server(model, settings, **engine_settings))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def smol_server(smol_model_dir):
    """One live server with the real embedded model on its defaults for this host, shared by a module."""
    server = start_live_server(smol_model_dir, dtype="auto", threads=0)
    yield server
    server.stop()


@pytest.fixture
def client(server):
    """A real WebSocket client on the module's `server`."""
    from .client import WsClient

    ws = WsClient(server.ws_url)
    yield ws
    ws.close()


@pytest.fixture(scope="session", autouse=True)
def _single_threaded_torch_in_the_test_process():
    """Unit tests run small torch ops here on one thread: their numbers and their time never depend on how many
    cores the host has (model workers are forked by the fork server, never by this process)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet_http_logs():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def float32_servers(smol_model_dir):
    """`get(backend)`: the live float32 server on that backend, started on first use and kept for every later
    module of this xdist worker (the two backends' API tests and the SDK tests ask for the same one; a vLLM start
    is ~35 s of a 2-core host). float32: in bfloat16 vLLM's and transformers' kernels round near-ties differently."""
    servers = {}

    def get(backend: str) -> LiveServer:
        if backend not in servers:
            servers[backend] = start_live_server(smol_model_dir, backend=backend, dtype="float32", threads=0)
        return servers[backend]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module", params=["hf", "vllm"])
def float32_server(request, float32_servers) -> LiveServer:
    """The shared float32 server on each backend in turn (the module's tests run once per backend)."""
    server = float32_servers(request.param)
    assert server.state.engine.num_running == 0, "a module before this one left a request running"
    return server


@pytest.fixture(scope="module")
def sdk_server(float32_server) -> LiveServer:
    """The live server on each backend, for the `openai` SDK tests."""
    return float32_server


def sdk(server) -> "openai.OpenAI":
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
