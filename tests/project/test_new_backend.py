"""``docs/architecture.md`` says a new backend is three files: its adapter file, its entry in
``adapters/__init__.py``, and its tests. Checked here by doing it: a vendored copy of the package gets a
backend for a wrapper it has never seen (``boxlib.Box``) from one new file and the one entry, nothing else,
and every operation then serves it, the stack builder and the doctor's list included."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from wrapkit.cli.vendor import vendor

LIBRARY = '''
import torch


class Box(torch.nn.Module):
    """A training wrapper wrapkit has never seen: one whole replica under ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
'''

ADAPTER = '''
"""``boxlib.Box``: one whole replica per process."""

from __future__ import annotations

import torch

from .._imports import is_instance
from .core.kinds import ReplicatedAdapter
from .core.recipes import Recipe, Setting, whole


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    from boxlib import Box

    return Box(whole(model, setting))


class BoxAdapter(ReplicatedAdapter):
    name = "box"
    recipe = Recipe(("box",), _build, order=6)

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "boxlib", "Box")
'''

CHECKS = '''
import sys
import tempfile

import torch

sys.path[:0] = [{root!r}, {lib!r}]
import boxlib
from pkg._vendor import wrapkit as wk
from pkg._vendor.wrapkit.cli._models import BACKENDS, build, supports, tiny_llama

# Without the adapter a wrapper-shaped object is refused; with it, it is a backend of its own.
assert "box" in BACKENDS, BACKENDS
assert supports("box", "flat") is None and "not of box" in supports("box", "hsdp")
wm = wk.adapt(build("box", seed=0))
assert wm.backend == "box" and wm.stack == ("box", "LlamaForCausalLM"), wm.stack
assert wm.unwrap() is wm.module.module and wm.config is wm.unwrap().config
inner = wm.unwrap()
want = {{k: v.clone() for k, v in inner.state_dict().items()}}
full = wm.full_state_dict()
assert set(full) == set(want) and all(torch.equal(full[k], want[k]) for k in want)
streamed = {{name for _, entries in wm.stream_full_parameters(layout="runtime") for name, *_ in entries}}
assert streamed == {{n for n, _ in inner.named_parameters()}}, streamed
ids = torch.randint(0, 128, (1, 6))
with tempfile.TemporaryDirectory() as d:
    wm.save_pretrained(d)
    other = wk.adapt(build("box", seed=1))
    result = other.load(d)
    assert not result.missing_keys and not result.unexpected_keys, result
    assert all(torch.equal(other.unwrap().state_dict()[k], want[k]) for k in want)
ref = wk.prepare_reference(wm, None)
assert ref.unwrap() is not inner and not any(p.requires_grad for p in ref.unwrap().parameters())
with torch.no_grad():
    assert torch.equal(ref.module(ids).logits, wm.module.eval()(ids).logits)
wm.place("cpu")
print("served:", wm.describe().splitlines()[0])
'''


def test_a_new_backend_is_its_file_and_one_registry_entry(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "_vendor").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "_vendor" / "__init__.py").write_text("")
    package = vendor(tmp_path / "pkg" / "_vendor")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "boxlib.py").write_text(LIBRARY)

    # The new backend: its adapter file,
    (package / "adapters" / "box.py").write_text(ADAPTER)
    # and its entry in the registry: imported, and placed among the wrappers.
    registry = package / "adapters" / "__init__.py"
    text = registry.read_text()
    assert text.count("    DDPAdapter,\n") == 1
    registry.write_text(text.replace("from .ddp import DDPAdapter\n", "from .box import BoxAdapter\nfrom .ddp import "
                                     "DDPAdapter\n").replace("    DDPAdapter,\n", "    BoxAdapter,\n    DDPAdapter,\n"))

    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECKS.format(root=str(tmp_path), lib=str(lib)))],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "served: backend:      box" in out.stdout, out.stdout


def test_without_its_adapter_the_wrapper_is_refused() -> None:
    """The same wrapper, unknown to the package as installed (this process's: the test above registered it in a
    copy, in a process of its own): refused, not peeled by guessing."""
    import wrapkit
    from wrapkit.cli._models import tiny_llama

    namespace: dict[str, Any] = {}
    exec(textwrap.dedent(LIBRARY), namespace)
    with pytest.raises(wrapkit.UnsupportedModelError, match="Box"):
        wrapkit.adapt(namespace["Box"](tiny_llama()))
