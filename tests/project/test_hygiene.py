"""Importing and adapting must not pull optional libraries into the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import wrapkit

OPTIONAL = ("deepspeed", "accelerate", "transformers", "peft", "trl")
PACKAGE = Path(wrapkit.__file__).resolve().parent  # the one imported: a checkout or an installed wheel


def test_adapt_imports_no_optional_library(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, torch, torch.distributed as dist
        import wrapkit
        wm = wrapkit.adapt(torch.nn.Linear(4, 4))
        assert wm.backend == "plain" and wm.num_parameters() == 20
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        wm = wrapkit.adapt(ddp)
        assert wm.backend == "ddp" and wm.world_size == 1
        wm.describe()
        try:
            wm.config
        except wrapkit.MissingConfigError:
            pass
        dist.destroy_process_group()
        print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_module_level_imports_are_torch_only() -> None:
    """Rule 1 of the design, checked statically: optional libraries only inside functions."""
    import ast

    allowed = {"torch", "typing_extensions", "__future__"}
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            offenders += [f"{path.name}: {r}" for r in roots if r not in allowed and r not in stdlib]
    assert offenders == []


def test_package_never_spells_its_own_name_in_imports() -> None:
    """Rule 2: relative imports only, so a vendored copy works unchanged."""
    import ast

    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("wrapkit"):
                offenders.append(str(path))
            if isinstance(node, ast.Import) and any(a.name.startswith("wrapkit") for a in node.names):
                offenders.append(str(path))
    assert offenders == []
