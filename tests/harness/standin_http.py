"""The HTTP side of the stand-in engines (``tests/engines/sglang_standin.py``, ``vllm_server_standin.py``,
``lora_standin.py``): a threaded server on loopback that hands each request to ``handle(method, route, body)``
and sends its ``(status, answer)`` back, a string as plain text (as vLLM answers some successes), anything else
as JSON; and ``Servers``, which the tests start them with."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import torch

Handle = Callable[[str, str, dict[str, Any]], tuple[int, Any]]


def serve(port: int, handle: Handle) -> None:
    """Serve on ``127.0.0.1:port`` until killed; prints ``ready`` once it listens."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
            status, answer = handle(method, self.path.strip("/"), json.loads(body or b"{}"))
            text = isinstance(answer, str)
            data = answer.encode() if text else json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (the names http.server calls)
            self._answer("POST")

        def do_GET(self) -> None:  # noqa: N802
            self._answer("GET")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


def main(handle: Callable[[], Handle]) -> None:
    """A stand-in's command line: ``--port P``; one torch thread (two run beside the test's ranks)."""
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    serve(a.port, handle())


class Servers:
    """``count`` copies of a stand-in ``script``, each a process of its own on a free loopback port, all started
    before any is waited for; ``urls`` once each has said it listens."""

    def __init__(self, script: Path, count: int = 1) -> None:
        from wrapkit.cli._workers import free_port

        ports = [free_port() for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.procs = [subprocess.Popen([sys.executable, str(script), "--port", str(p)], stdout=subprocess.PIPE,
                                       text=True) for p in ports]
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "ready" once it listens (or nothing if it died)
            assert line.strip() == "ready", f"the stand-in {script.name} did not start: {line!r}"

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=30)


class Standin(Servers):
    """One stand-in engine server of ``script``; ``mode(family, **behaviour)`` gives it a fresh model of that
    family (``size``: a Llama of that size instead) and the behaviour its ``/standin_mode`` route takes."""

    def __init__(self, script: Path) -> None:
        super().__init__(script)
        self.url = self.urls[0]

    def mode(self, family: str = "llama", **behaviour: Any) -> Standin:
        from wrapkit.integrations.engines._engine_wire import call

        assert call(self.url, "standin_mode", {"family": family, **behaviour}, 120)["success"]
        return self


S = TypeVar("S", bound=Servers)


@contextlib.contextmanager
def running(servers: S) -> Iterator[S]:
    """``servers``, stopped at the end (a fixture's body)."""
    try:
        yield servers
    finally:
        servers.stop()


def standin_model(req: dict[str, Any]) -> torch.nn.Module:
    """The model a stand-in engine holds after ``/standin_mode``: a Llama of ``req["size"]`` (the benchmarks'),
    else the tiny model of ``req["family"]``, seeded apart from the trainer's."""
    from wrapkit.cli._families import family_model
    from wrapkit.cli._models import tiny_llama

    size = req.get("size")
    return (tiny_llama(1234, **size) if size else family_model(req.get("family", "llama"), seed=1234)).eval()
