"""The documentation site (``mkdocs.yml``, ``docs/``) builds in strict mode, so a broken link, a page left out of
the navigation, a reference that does not resolve or any other warning fails; every public name has an entry in
the API reference; README stays a first visit's page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import wrapkit

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    # The reference is generated from the docstrings: adapt()'s own text is there.
    first = [w.strip("`") for w in (wrapkit.adapt.__doc__ or "").split()[:4]]
    assert first and " ".join(first) in re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", reference)), first
    index = (tmp_path / "site" / "index.html").read_text()
    assert "examples/quickstart.py" in index and "--8&lt;--" not in index  # README's quick start, included


def test_every_public_name_has_a_reference_entry() -> None:
    entries = set(re.findall(r"^::: wrapkit\.(\w+)$", (ROOT / "docs" / "reference.md").read_text(), re.M))
    assert entries == set(wrapkit.__all__), set(wrapkit.__all__) ^ entries


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert all(f": {page}" in nav for page in pages), sorted(p for p in pages if f": {p}" not in nav)


def test_readme_is_a_first_visits_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for heading in ("## Quick start", "## What works where", "## Guide", "## Development"):
        assert heading in readme, heading
    # Its links into the guide resolve.
    for link in re.findall(r"\]\((docs/[^)#]+)\)", readme):
        assert (ROOT / link).is_file(), link


def _public_callables() -> list[tuple[str, object]]:
    from wrapkit import WrappedModel

    out: list[tuple[str, object]] = [(n, getattr(wrapkit, n)) for n in (
        "adapt", "prepare_reference", "read_checkpoint", "shutdown", "register_adapter", "canonical_name")]
    out += [(f"WrappedModel.{n}", fn) for n, fn in vars(WrappedModel).items()
            if callable(fn) and not n.startswith("_")]
    return out


def test_every_parameter_and_error_of_the_public_api_is_documented() -> None:
    """The reference lists each parameter (``:param name:``) of every public function and ``WrappedModel``
    method, and each that can refuse its input says which error (``:raises``)."""
    import inspect

    undocumented = []
    for name, fn in _public_callables():
        doc = inspect.getdoc(fn) or ""
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]  # type: ignore[arg-type]
        undocumented += [f"{name}({p})" for p in params if f":param {p}:" not in doc]
        if params and ":raises " not in doc:
            undocumented.append(f"{name}: no :raises")
    assert not undocumented, undocumented
