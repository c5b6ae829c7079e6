"""README's Python cannot drift from the code: the quick start is the example file, every Python block of README
and the documentation's pages compiles, and the quick start runs under torchrun with each backend's ``wrap`` from
README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.launch import ROOT, torchrun

README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
STACK = {"ddp": "stack:        ddp > LlamaForCausalLM", "fsdp2": "stack:        fsdp2 > LlamaForCausalLM",
         "zero3": "stack:        deepspeed > LlamaForCausalLM"}
WRAP = re.compile(r"^def wrap\(model\):\n.*?(?=^\S)", re.S | re.M)


def _blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def _wraps() -> dict[str, str]:
    """README's alternative ``wrap`` functions, by backend."""
    found = {}
    for block in _blocks():
        if block.startswith("def wrap(model):"):
            found["zero3" if "deepspeed" in block else "fsdp2"] = block
    return found


def test_quickstart_block_is_the_example() -> None:
    assert QUICKSTART.read_text() in _blocks(), "README's quick start differs from examples/quickstart.py"


def test_every_python_block_compiles() -> None:
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    total = 0
    for page in pages:
        for i, block in enumerate(BLOCK.findall(page.read_text())):
            compile(block, f"{page.relative_to(ROOT)} python block {i}", "exec")
            total += 1
    assert len(_blocks()) >= 3 and total >= 15, total


def test_readme_shows_fsdp2_and_zero3_wraps() -> None:
    assert set(_wraps()) == {"fsdp2", "zero3"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["ddp", pytest.param("fsdp2", marks=pytest.mark.long),
                                     pytest.param("zero3", marks=pytest.mark.long)])
def test_quickstart_runs(backend: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    source = QUICKSTART.read_text()
    if backend != "ddp":
        source, n = WRAP.subn(lambda _: _wraps()[backend] + "\n\n", source)
        assert n == 1
    script = tmp_path / "quickstart.py"
    script.write_text(source)
    proc = torchrun(script, str(tmp_path / "quickstart-model"), cwd=tmp_path)
    assert f"reloaded from {tmp_path / 'quickstart-model'}: same logits" in proc.stdout
    assert STACK[backend] in proc.stdout
    assert (tmp_path / "quickstart-model" / "config.json").is_file()
    if backend == "ddp":
        # README's first screen shows this output: its lines, but the losses and the path, are what ran.
        shown = README.read_text().split("It prints, on rank 0")[1].split("```text\n")[1].split("```")[0]
        printed = proc.stdout.splitlines()
        for line in shown.splitlines():
            if not line.startswith(("loss ", "reloaded from ")):
                assert line in printed, f"README shows {line!r}; the quick start printed\n{proc.stdout}"
