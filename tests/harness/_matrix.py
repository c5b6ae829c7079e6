"""Case matrices (operation x backend x precision x topology) as one test id per case, run together.

A test parametrized with ``cases(CASES)`` gets one id per case (``test_sleep_wake[fsdp2-level=1]``), so
``pytest -k "sleep and fsdp2"`` selects the FSDP2 cases alone. ``run(request, group, scenario)`` runs every
case of that test which this session selected in one ``group.run`` (a call per case would pay the workers'
round trip and the scenario's imports each time) and returns this case's observation from every rank. The
scenario takes a list of case dicts and returns its observations keyed by ``key(case)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["cases", "key", "long", "run"]

Case = dict[str, Any]
_RESULTS = pytest.StashKey[dict[Any, Any]]()


def key(case: Case) -> str:
    """The key the scenarios give a case's observation under."""
    return repr(sorted(case.items()))


def _id(case: Case) -> str:
    return "-".join([str(case["spec"]), *(f"{k}={v}" for k, v in case.items() if k != "spec")])


def long(*values: Any, id: str | None = None) -> Any:  # noqa: A002 (pytest.param's own name)
    """One parameter set marked ``long``: left out of the default selection, run by ``--run-long``."""
    return pytest.param(*values, id=id, marks=pytest.mark.long)


def cases(matrix: list[Case], long_cases: list[Case] | None = None) -> Any:
    """``@cases(CASES, MORE)``: the test takes ``case``, one id per case; the cases in ``MORE`` are ``long``."""
    params = [pytest.param(c, id=_id(c)) for c in matrix] + [long(c, id=_id(c)) for c in long_cases or []]
    return pytest.mark.parametrize("case", params)


def run(request: pytest.FixtureRequest, group: Any, scenario: Callable[[list[Case]], dict[str, Any]],
        timeout: float) -> list[Any]:
    """This test's ``case`` as every rank observed it; the first case of a test to ask runs all the
    selected ones. A failure of that run fails each of them with the same error."""
    node = request.node
    results = request.session.stash.setdefault(_RESULTS, {})
    function = getattr(node, "function", None)
    if function not in results:
        selected = [item.callspec.params["case"] for item in request.session.items
                    if getattr(item, "function", None) is function]
        try:
            results[function] = group.run(scenario, selected, timeout=timeout)
        except Exception as exc:
            results[function] = exc
    outcome = results[function]
    if isinstance(outcome, Exception):
        raise outcome
    this = key(node.callspec.params["case"])
    return [per_rank[this] for per_rank in outcome]
