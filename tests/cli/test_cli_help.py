"""The command line's help reads as plain text in 100 columns, whatever the terminal's width."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wrapkit.cli import main


@pytest.mark.parametrize("command", [[], ["doctor"], ["bench"], ["vendor"]])
def test_help_fits_100_columns_as_plain_text(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (argparse reads COLUMNS each time it formats); the command itself is run once below.
    for columns in ("60", "240"):
        monkeypatch.setenv("COLUMNS", columns)
        with pytest.raises(SystemExit) as exited:
            main([*command, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert max(len(line) for line in lines) <= 100, out
        # Nothing cut off with "..." (argparse's own "{doctor,bench,vendor} ..." in the usage line aside).
        cut = [line for line in lines if line.rstrip().endswith("...") and not line.startswith("usage:")]
        assert "``" not in out and not cut, out
        if command == ["doctor"] and columns == "240":
            # Every option says what it is for, and no name is broken at a hyphen.
            assert "--world-size N        ranks to start" in out, out
            assert "llama-reward" in out and "--model FAMILY" in out
        if command == ["vendor"]:
            assert "dest " in out and "the directory to copy into" in out and "--name" in out


def test_the_command_prints_its_help() -> None:
    """``python -m wrapkit --help`` as a user runs it: the module's entry point reaches the same parser."""
    out = subprocess.run([sys.executable, "-m", "wrapkit", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "doctor" in out.stdout and "vendor" in out.stdout, out.stdout + out.stderr


def test_the_doctor_header_never_breaks_a_version() -> None:
    from wrapkit.cli.doctor import _wrap_items

    items = [f"package{i} {i}.{i}.{i}" for i in range(12)]
    lines = _wrap_items("wrapkit doctor: ", items).splitlines()
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines)
    assert all(any(f"package{i} {i}.{i}.{i}" in line for line in lines) for i in range(12))
