"""The control plane of an engine in another process: JSON calls on its HTTP routes, each with a timeout; and
which models an engine sync serves (those held by every rank of the job, over which its outcome is agreed).
(The data plane, the engine's weight-update group, is built by ``base/process_groups.py``.)"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist

from ..._agree import broadcast_object, span
from ..._errors import EngineError, UnsupportedModelError

__all__ = ["EngineSync", "call", "request", "refuse_partial", "distributed", "rank", "world_size", "share", "why",
           "in_thread", "answer_of", "sent_or_answered", "said", "agree", "connection_problem", "join_beside",
           "on_sender"]


class EngineSync(NamedTuple):
    """What one ``sync`` moved, the same on every trainer rank. ``buckets``: the broadcasts the engine received.
    ``verified``: the tensors whose first row the engine echoed back equal to what was sent (SGLang's
    ``get_weights_by_name``, for the first and last tensor of each bucket; empty where the engine's model cannot
    echo a name). ``version``: the weight version the engine reported holding after the sync (vLLM), None where
    the engine keeps none (SGLang)."""

    tensors: int
    buckets: int
    bytes: int
    seconds: float
    verified: list[str]
    version: str | None = None


def call(base_url: str, route: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``payload`` to ``base_url/route`` and return the JSON answer, whatever its status (an engine
    answers a refusal with 400 and ``{"success": false, "message": ...}``). An engine that does not answer
    within ``timeout`` seconds, or cannot be reached, raises ``EngineError``."""
    return request(base_url, route, payload, timeout)[1]


def request(base_url: str, route: str, payload: dict[str, Any] | None, timeout: float,
            method: str = "POST") -> tuple[int, dict[str, Any]]:
    """``call`` with the HTTP status beside the answer, and GET where ``method`` says so (``payload`` None).
    A body that is not JSON is the answer's ``message`` (vLLM answers some successes in plain text); a refusal
    without one says its status."""
    url = base_url.rstrip("/") + "/" + route.lstrip("/")
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            status, body = reply.status, reply.read()
    except urllib.error.HTTPError as exc:  # a refusal still carries the engine's reason
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        # The time actually waited: a refused connection fails at once, long before the timeout.
        waited = time.monotonic() - start
        what = (f"did not answer within {waited:.1f} s (timeout {timeout:.0f} s)"
                if isinstance(reason, TimeoutError) or waited >= timeout else f"failed after {waited:.1f} s")
        raise EngineError(f"{url} {what} ({reason}); check that the engine is up and serves this route, or pass a "
                          "longer timeout") from exc
    text = body[:300].decode(errors="replace")
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        if status < 400:
            return status, {"message": body.decode(errors="replace")}
        answer = {}
    if not isinstance(answer, dict):
        answer = {"value": answer}
    if status >= 400:
        answer.setdefault("success", False)
        answer.setdefault("message", f"HTTP {status}: {text}")
    return status, answer


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 outside a distributed job)."""
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def share(value: Any, src_rank: int) -> Any:
    """``value`` as global rank ``src_rank`` has it, on every rank (itself outside a distributed job)."""
    return broadcast_object(value, src_rank, None) if distributed() else value


def refuse_partial(wm: Any, where: str, why: str, fix: str = "") -> None:
    """An engine sync agrees over the job's ranks, so it serves a model that all of them hold: raise
    ``UnsupportedModelError`` (``where``, then ``why`` it needs them all, then ``fix``) for one held by some of them
    only, or for each rank's own unsharded copy in a multi-rank job. The same on every rank, before any collective."""
    from ..._registry import as_adapter

    below = as_adapter(wm, "an engine sync")
    if world_size() == 1:
        return
    held_by = span(below) if below.distributed else 1  # 1: each rank's own copy, nothing says they are alike
    if held_by == world_size():
        return
    raise UnsupportedModelError(f"{where}: the model lies over {held_by} of the job's {world_size()} ranks; {why}, "
                                f"so it serves a model held by all of them (one copy, or replicas of it){fix}")


def why(exc: BaseException) -> str:
    """An exception as an engine sync reports it: an ``EngineError``'s own words, else its type and message."""
    return str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"


CALL_THREAD = "wrapkit-engine-call"  # the name of in_thread's threads: one left waiting ends by its own timeout


def in_thread(fn: Callable[[], Any]) -> tuple[dict[str, Any], threading.Thread]:
    """Run ``fn`` beside a blocking collective (an engine call, or the join of a group while the engine is
    called): its ``"value"``, or its ``"error"``, lands in the returned dict."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as exc:
            box["error"] = why(exc)

    thread = threading.Thread(target=run, daemon=True, name=CALL_THREAD)
    thread.start()
    return box, thread


def answer_of(box: dict[str, Any]) -> dict[str, Any]:
    """An engine call's answer from ``in_thread``'s box; a call that failed or is still waiting reads as a
    refusal saying so."""
    if "value" in box:
        return dict(box["value"])
    return {"success": False, "message": box.get("error", "nothing (still waiting when the timeout ran out)")}


def sent_or_answered(done: Callable[[], bool], nbytes: int, timeout: float,
                     answered: Callable[[], str | None]) -> str | None:
    """Wait, polling, until a broadcast of ``nbytes`` just issued has left this rank (``done()``), and return None.
    Where the engine answers its update call meanwhile (``answered()`` gives what it said), stop waiting and return
    that: a receiver that gave up takes no further chunk, so the broadcast would only end by its timeout, and the
    answer is the error worth reporting. ``EngineError`` after ``timeout`` seconds: an engine that stopped
    receiving must not hold the rank for ever."""
    import time

    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not done():
        answer = answered()
        if answer is not None:
            return answer
        if time.monotonic() > deadline:
            raise EngineError(f"a broadcast of {nbytes} bytes did not complete within {timeout:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)  # quick for small chunks, cheap for long waits
    return None


def said(answer: dict[str, Any], status: int = 0) -> str:
    """What an engine said in a refusal: vLLM's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``, SGLang's
    ``{"message"}``, else the whole answer; after ``HTTP status:`` where the status is given."""
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    message = message or answer.get("detail") or answer.get("message") or answer
    return f"HTTP {status}: {message}" if status else str(message)


def agree(error: str | None, broken: bool, src_rank: int, close: Callable[[], None]) -> str | None:
    """The sending rank's outcome of an engine call, on every trainer rank. Where its weight group fell out of
    step (``broken`` on the sending rank) every rank calls ``close``, so that each needs ``connect()`` again,
    together. Returns the error, the same on every rank."""
    error, broken = share((error, broken), src_rank)
    if broken:
        close()
    return error


def connection_problem(timeout: object, port: object) -> str | None:
    """What is wrong with an engine's ``timeout`` (seconds) or ``master_port`` (None: not given), if anything."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        return f"timeout={timeout!r}: pass a positive number of seconds"
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        return f"master_port={port!r}: pass a free TCP port"
    return None


def join_beside(join: Callable[[], Any], init: Callable[[], str | None], timeout: float) -> Any:
    """Join an engine's weight group (``join``) while ``init`` asks the engine to bring its workers in: the
    engine's call returns once they joined, so both run at once, the join in a thread. ``init`` returns None once
    the engine accepted, else its refusal, raised at once as ``EngineError`` (the join then ends by its own
    timeout). Returns what ``join`` returned."""
    joined, thread = in_thread(join)
    refused = init()
    if refused is not None:
        raise EngineError(refused)
    thread.join(timeout)
    if "value" not in joined:
        raise EngineError(f"the engine accepted the weight group but this rank could not join it: "
                          f"{joined.get('error', f'not within {timeout:.0f} s')}")
    return joined["value"]


def on_sender(src_rank: int, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()`` on the sending rank and its failure as a message (``(None, None)`` on the others): every rank
    then learns the outcome where it is agreed (``agree``)."""
    if rank() != src_rank:
        return None, None
    try:
        return fn(), None
    except Exception as exc:  # any failure: the other ranks wait for the agreed outcome
        return None, why(exc)
