"""The command line's help reads as plain text in 100 columns, whatever the terminal's width."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", [[], ["doctor"], ["bench"], ["vendor"]])
def test_help_fits_100_columns_as_plain_text(command: list[str]) -> None:
    for columns in ("60", "240"):
        out = subprocess.run([sys.executable, "-m", "wrapkit", *command, "--help"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "COLUMNS": columns})
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert max(len(line) for line in lines) <= 100, out.stdout
        # Nothing cut off with "..." (argparse's own "{doctor,bench,vendor} ..." in the usage line aside).
        cut = [line for line in lines if line.rstrip().endswith("...") and not line.startswith("usage:")]
        assert "``" not in out.stdout and not cut, out.stdout
        if command == ["doctor"] and columns == "240":
            # Every option says what it is for, and no name is broken at a hyphen.
            assert "--world-size N        ranks to start" in out.stdout, out.stdout
            assert "llama-reward" in out.stdout and "--model FAMILY" in out.stdout
        if command == ["vendor"]:
            assert "dest " in out.stdout and "the directory to copy into" in out.stdout and "--name" in out.stdout


def test_the_doctor_header_never_breaks_a_version() -> None:
    from wrapkit.cli.doctor import _wrap_items

    items = [f"package{i} {i}.{i}.{i}" for i in range(12)]
    lines = _wrap_items("wrapkit doctor: ", items).splitlines()
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines)
    assert all(any(f"package{i} {i}.{i}.{i}" in line for line in lines) for i in range(12))
