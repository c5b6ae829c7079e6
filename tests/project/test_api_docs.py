"""The protocol table (``docs/guide/protocol.md``) and every other table of README and the guide agree with the
code: every call written there has the signature the public object has (parameter names, defaults, keyword-only
markers), on the adapters, the PEFT reference view and the ``WrappedModel`` protocol alike."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import wrapkit
from wrapkit._adapt import AdapterDisabledView

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# `wm.name(args)` or `wrapkit.name(args)` in the first column of a table row.
CALL = re.compile(r"^\| `(?:with )?(wm|wrapkit)\.(\w+)\(([^`]*?)\)")
EXTRA_CALL = re.compile(r"`(wm|wrapkit)\.(\w+)\(([^`]*?)\)`")


def _documented() -> list[tuple[str, str, str]]:
    rows = []
    for line in (line for page in PAGES for line in page.read_text().splitlines()):
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        rows += [(owner, name, args) for owner, name, args in EXTRA_CALL.findall(first + "`")]
        m = CALL.match(line)
        if m and m.groups() not in rows:
            rows.append(m.groups())
    return rows


def _signature(fn: Any) -> str:
    parts: list[str] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


def _normalise(args: str) -> str:
    return ", ".join(a.strip() for a in args.split(",") if a.strip())


DOCUMENTED = _documented()


def test_readme_lists_the_api() -> None:
    names = {name for _, name, _ in DOCUMENTED}
    assert {"unwrap", "place", "gathered", "full_state_dict", "copy_to", "prepare_reference",
            "register_adapter", "read_checkpoint", "registered_adapters"} <= names


@pytest.mark.parametrize(("owner", "name", "args"), DOCUMENTED, ids=[f"{o}.{n}" for o, n, _ in DOCUMENTED])
def test_readme_signature_matches_code(owner: str, name: str, args: str) -> None:
    owners = [getattr(wrapkit, name)] if owner == "wrapkit" else [
        getattr(cls, name) for cls in (wrapkit.Adapter, AdapterDisabledView, wrapkit.WrappedModel)
        if hasattr(cls, name)]
    assert owners, f"README documents {owner}.{name}, which does not exist"
    for fn in owners:
        assert _signature(fn) == _normalise(args), f"README: {owner}.{name}({args}); code: {fn.__qualname__}"
