"""A vendored copy under another package imports and passes the contract tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.contract.test_contract import check
from tests.harness import scenarios
from wrapkit.cli.vendor import vendor

VENDORED = "pkg._vendor.wrapkit"


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vendoring")
    (root / "pkg" / "_vendor").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "_vendor" / "__init__.py").write_text("")
    target = vendor(root / "pkg" / "_vendor")
    assert (target / "VENDORED").read_text().startswith("Vendored copy of wrapkit")
    assert (target / "LICENSE").exists() and (target / "py.typed").exists()
    return root


def test_vendor_refuses_to_overwrite(vendored: Path) -> None:
    with pytest.raises(FileExistsError):
        vendor(vendored / "pkg" / "_vendor")


def test_vendored_copy_imports_alone(vendored: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(vendored)!r})
        import torch
        from {VENDORED.rsplit('.', 1)[0]} import wrapkit as wk
        wm = wk.adapt(torch.nn.DataParallel(torch.nn.Linear(3, 3)))
        assert wm.backend == "dp" and wm.num_parameters() == 12
        try:
            wk.adapt(None)
        except wk.UnsupportedModelError:
            pass
        print("installed copy imported:", "wrapkit" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("installed copy imported: False")


@pytest.mark.parametrize("spec", ["plain", "dp>compile>peft"])
def test_vendored_contract_local(vendored: Path, spec: str) -> None:
    check(scenarios.vendored_contract(str(vendored), spec, VENDORED), spec, 1, 0)


@pytest.mark.parametrize("spec", ["ddp>compile>peft", "fsdp", "fsdp2>peft", "zero3"])
def test_vendored_contract_distributed(group: Any, vendored: Path, spec: str) -> None:
    results = group.run(scenarios.vendored_contract, str(vendored), spec, VENDORED, timeout=180)
    for rank, obs in enumerate(results):
        check(obs, spec, group.world_size, rank)
