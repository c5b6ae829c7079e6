"""The control plane of an engine in another process: JSON calls on its HTTP routes, each with a timeout.
(The data plane, the engine's weight-update group, is built by ``base/process_groups.py``.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from .._errors import EngineError

__all__ = ["call"]


def call(base_url: str, route: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``payload`` to ``base_url/route`` and return the JSON answer, whatever its status (an engine
    answers a refusal with 400 and ``{"success": false, "message": ...}``). An engine that does not answer
    within ``timeout`` seconds, or cannot be reached, raises ``EngineError``."""
    url = base_url.rstrip("/") + "/" + route.lstrip("/")
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:  # a refusal still carries the engine's reason
        body = exc.read()
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {"value": answer}
        answer.setdefault("success", False)
        answer.setdefault("message", f"HTTP {exc.code}: {body[:300].decode(errors='replace')}")
        return answer
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EngineError(f"{url} did not answer within {timeout:.0f} s ({reason}); check that the engine is up "
                          "and serves this route, or pass a longer timeout") from exc
    try:
        answer = json.loads(body or b"{}")
    except ValueError as exc:
        raise EngineError(f"{url} answered something that is not JSON: {body[:300]!r}") from exc
    return answer if isinstance(answer, dict) else {"value": answer}
