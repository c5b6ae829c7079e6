"""``wrapkit vendor DEST``: copy the package into another project's tree."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["vendor"]


def vendor(dest: str | Path, name: str | None = None) -> Path:
    """Copy this package to ``DEST/<name>`` (default: the package's own directory name).

    Relative imports make the copy work under any parent package. A ``VENDORED``
    note records the version copied; the license travels with it.
    """
    from .. import __version__

    src = Path(__file__).resolve().parent.parent
    target = Path(dest) / (name or src.name)
    if target.exists():
        raise FileExistsError(f"{target} already exists; remove it first or choose another destination.")
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    license_file = src.parent / "LICENSE"
    if license_file.exists():
        shutil.copy(license_file, target / "LICENSE")
    (target / "VENDORED").write_text(
        f"Vendored copy of wrapkit {__version__}. Do not edit here; update by running "
        f"`wrapkit vendor` again.\n"
    )
    return target
