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
    from ..base.version import __version__

    src = Path(__file__).resolve().parent.parent
    target = Path(dest) / (name or src.name)
    if target.exists():
        raise FileExistsError(f"{target} already exists; remove it first, or pass --name for another directory.")
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    license_file = _license(src)
    if license_file is not None:
        shutil.copy(license_file, target / "LICENSE")
    (target / "VENDORED").write_text(
        f"Vendored copy of wrapkit {__version__}. Do not edit here; update by running "
        f"`wrapkit vendor` again.\n"
    )
    return target


def _license(src: Path) -> Path | None:
    """The license file: beside the package in a checkout, in the distribution's metadata when
    installed from a wheel."""
    if (src.parent / "LICENSE").is_file():
        return src.parent / "LICENSE"
    from importlib import metadata

    try:
        files = metadata.distribution("wrapkit").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "LICENSE":
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None
