"""The bad-input catalogue: every public function, each argument given a wrong type, a wrong value
or called in a wrong state, raises a typed ``WrapkitError`` saying what to pass, with the model
unchanged. In-process, on a plain model and on the adapter-disabled view of a PEFT model; the
distributed agreement on such errors is tested per operation elsewhere (test_errors, test_calls)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import wrapkit
from wrapkit.cli._models import build, tiny_llama
from wrapkit.integrations.vllm import load_into

Case = tuple[str, Callable[[Any, Any, Path], Any], type[wrapkit.WrapkitError]]


def _enter(cm: Any) -> None:
    with cm:
        pass


def _file(tmp: Path, text: bytes) -> str:
    path = tmp / "bad.safetensors"
    path.write_bytes(text)
    return str(path)


CASES: list[Case] = [
    # module-level functions
    ("adapt(model=42)", lambda wm, other, tmp: wrapkit.adapt(42), wrapkit.UnsupportedModelError),
    ("adapt(model=DataParallel(DataParallel))",
     lambda wm, other, tmp: wrapkit.adapt(torch.nn.DataParallel(torch.nn.DataParallel(torch.nn.Linear(2, 2)))),
     wrapkit.UnsupportedModelError),
    ("prepare_reference(policy=42)", lambda wm, other, tmp: wrapkit.prepare_reference(42),
     wrapkit.UnsupportedModelError),
    ("prepare_reference(ref_model='x')", lambda wm, other, tmp: wrapkit.prepare_reference(wm, "x"),
     wrapkit.UnsupportedModelError),
    ("prepare_reference(ref_model=policy)", lambda wm, other, tmp: wrapkit.prepare_reference(wm, wm.module),
     wrapkit.ReferenceModelError),
    ("prepare_reference(ds_config=) without DeepSpeed",
     lambda wm, other, tmp: wrapkit.prepare_reference(wm, ds_config={}), wrapkit.ReferenceModelError),
    ("canonical_name(name=42)", lambda wm, other, tmp: wrapkit.canonical_name(42), wrapkit.ArgumentError),
    ("read_checkpoint(path=42)", lambda wm, other, tmp: wrapkit.read_checkpoint(42), wrapkit.ArgumentError),
    ("read_checkpoint(missing)", lambda wm, other, tmp: wrapkit.read_checkpoint(tmp / "none"),
     wrapkit.StateDictError),
    ("read_checkpoint(corrupt)", lambda wm, other, tmp: wrapkit.read_checkpoint(_file(tmp, b"\x08\x00not")),
     wrapkit.StateDictError),
    ("register_adapter(cls=42)", lambda wm, other, tmp: wrapkit.register_adapter(42),
     wrapkit.AdapterRegistrationError),
    # methods
    ("unwrap(keep_peft='no')", lambda wm, other, tmp: wm.unwrap(keep_peft="no"), wrapkit.ArgumentError),
    ("unwrap(keep_compile=1)", lambda wm, other, tmp: wm.unwrap(keep_compile=1), wrapkit.ArgumentError),
    ("num_parameters(trainable_only='x')", lambda wm, other, tmp: wm.num_parameters("x"), wrapkit.ArgumentError),
    ("place(device=2.5)", lambda wm, other, tmp: wm.place(2.5), wrapkit.PlacementError),
    ("place(device='not-a-device')", lambda wm, other, tmp: wm.place("not-a-device"), wrapkit.PlacementError),
    ("place(device='cuda:64')", lambda wm, other, tmp: wm.place("cuda:64"), wrapkit.PlacementError),
    ("gathered(modifier_rank='0')", lambda wm, other, tmp: _enter(wm.gathered("0")), wrapkit.DistributedStateError),
    ("gathered(modifier_rank=5)", lambda wm, other, tmp: _enter(wm.gathered(5)), wrapkit.DistributedStateError),
    ("generation(gather=3)", lambda wm, other, tmp: _enter(wm.generation(3)), wrapkit.ArgumentError),
    ("generation(gather='sideways')", lambda wm, other, tmp: _enter(wm.generation("sideways")),
     wrapkit.ArgumentError),
    ("full_state_dict(rank0_only='x')", lambda wm, other, tmp: wm.full_state_dict("x"), wrapkit.ArgumentError),
    ("full_state_dict(merge_adapters=1)", lambda wm, other, tmp: wm.full_state_dict(merge_adapters=1),
     wrapkit.ArgumentError),
    ("load_full_state_dict(sd=42)", lambda wm, other, tmp: wm.load_full_state_dict(42), wrapkit.WrapkitError),
    ("load_full_state_dict(sd=another architecture)",
     lambda wm, other, tmp: wm.load_full_state_dict({"w": torch.zeros(2)}), wrapkit.WrapkitError),
    ("load_full_state_dict(strict='x')",
     lambda wm, other, tmp: wm.load_full_state_dict(other.full_state_dict(), strict="x"), wrapkit.WrapkitError),
    ("save(path=42)", lambda wm, other, tmp: wm.save(42), wrapkit.ArgumentError),
    ("save(path=a directory)", lambda wm, other, tmp: wm.save(tmp), wrapkit.StateDictError),
    ("save(path=under a missing directory)", lambda wm, other, tmp: wm.save(tmp / "no" / "m.safetensors"),
     wrapkit.StateDictError),
    ("save_pretrained(directory=42)", lambda wm, other, tmp: wm.save_pretrained(42), wrapkit.ArgumentError),
    ("save_pretrained(directory=a file)",
     lambda wm, other, tmp: wm.save_pretrained(_file(tmp, b"x")), wrapkit.StateDictError),
    ("save_pretrained(max_shard_size=[])", lambda wm, other, tmp: wm.save_pretrained(tmp / "d", max_shard_size=[]),
     wrapkit.ArgumentError),
    ("save_pretrained(max_shard_size='lots')",
     lambda wm, other, tmp: wm.save_pretrained(tmp / "d", max_shard_size="lots"), wrapkit.ArgumentError),
    ("save_pretrained(merge_adapters='x')", lambda wm, other, tmp: wm.save_pretrained(tmp / "d", merge_adapters="x"),
     wrapkit.ArgumentError),
    ("load(path=42)", lambda wm, other, tmp: wm.load(42), wrapkit.WrapkitError),
    ("load(path=missing)", lambda wm, other, tmp: wm.load(tmp / "none"), wrapkit.WrapkitError),
    ("load(path=corrupt)", lambda wm, other, tmp: wm.load(_file(tmp, b"\x08\x00not")), wrapkit.WrapkitError),
    ("load(strict='x')", lambda wm, other, tmp: wm.load(tmp / "none", strict="x"), wrapkit.WrapkitError),
    ("load(src_rank='1')", lambda wm, other, tmp: wm.load(tmp / "none", src_rank="1"), wrapkit.WrapkitError),
    ("stream_full_parameters(bucket_bytes=0)", lambda wm, other, tmp: list(wm.stream_full_parameters(0)),
     wrapkit.ArgumentError),
    ("stream_full_parameters(bucket_bytes='1MB')", lambda wm, other, tmp: list(wm.stream_full_parameters("1MB")),
     wrapkit.ArgumentError),
    ("stream_full_parameters(dtype=torch.int32)",
     lambda wm, other, tmp: list(wm.stream_full_parameters(dtype=torch.int32)), wrapkit.ArgumentError),
    ("stream_full_parameters(dtype='bf16')", lambda wm, other, tmp: list(wm.stream_full_parameters(dtype="bf16")),
     wrapkit.ArgumentError),
    ("stream_full_parameters(merge_adapters='x')",
     lambda wm, other, tmp: list(wm.stream_full_parameters(merge_adapters="x")), wrapkit.ArgumentError),
    ("stream_full_parameters(keep_dtype='norm')",
     lambda wm, other, tmp: list(wm.stream_full_parameters(keep_dtype="norm")), wrapkit.ArgumentError),
    ("stream_full_parameters(dst_rank=5)", lambda wm, other, tmp: list(wm.stream_full_parameters(dst_rank=5)),
     wrapkit.ArgumentError),
    ("vllm.load_into(llm_or_model=42)",
     lambda wm, other, tmp: load_into(42, wm.stream_full_parameters()), wrapkit.UnsupportedModelError),
    ("vllm.load_into(llm_or_model=another architecture)",
     lambda wm, other, tmp: load_into(torch.nn.Linear(2, 2), wm.stream_full_parameters()), wrapkit.StateDictError),
    ("sleep(level=3)", lambda wm, other, tmp: wm.sleep(level=3), wrapkit.ArgumentError),
    ("sleep(level=True)", lambda wm, other, tmp: wm.sleep(level=True), wrapkit.ArgumentError),
    ("sleep(optimizer='adam')", lambda wm, other, tmp: wm.sleep("adam"), wrapkit.ArgumentError),
    ("wake() without sleep()", lambda wm, other, tmp: wm.wake(), wrapkit.DistributedStateError),
    ("copy_to(target=42)", lambda wm, other, tmp: wm.copy_to(42), wrapkit.UnsupportedModelError),
    ("copy_to(target=itself)", lambda wm, other, tmp: wm.copy_to(wm), wrapkit.WrapkitError),
    ("copy_to(alpha='x')", lambda wm, other, tmp: wm.copy_to(other, alpha="x"), wrapkit.ArgumentError),
    ("copy_to(alpha=2.0)", lambda wm, other, tmp: wm.copy_to(other, alpha=2.0), wrapkit.ArgumentError),
    ("copy_to(target=another architecture)",
     lambda wm, other, tmp: wm.copy_to(wrapkit.adapt(torch.nn.Linear(2, 2))), wrapkit.StateDictError),
]


def _state(*models: Any) -> list[Any]:
    out = []
    for m in models:
        root = m.module
        out.append({k: v.clone() for k, v in root.state_dict().items()})
        out.append([(mod.training, [p.requires_grad for p in mod.parameters(recurse=False)]) for mod in root.modules()])
        out.append({str(p.device) for p in root.parameters()})
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
        elif x != y:
            return False
    return True


@pytest.fixture(scope="module", params=["plain", "peft-view"])
def models(request: Any) -> tuple[Any, Any]:
    if request.param == "plain":
        return wrapkit.adapt(tiny_llama(0)), wrapkit.adapt(tiny_llama(1))
    policy = wrapkit.adapt(build("peft"))
    return wrapkit.prepare_reference(policy), wrapkit.adapt(tiny_llama(1))


@pytest.mark.parametrize("label, call, error", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_typed_error_and_changes_nothing(models: tuple[Any, Any], tmp_path: Path, label: str,
                                                            call: Callable[[Any, Any, Path], Any],
                                                            error: type[wrapkit.WrapkitError]) -> None:
    wm, other = models
    before = _state(wm, other)
    files = sorted(os.listdir(tmp_path))
    with pytest.raises(wrapkit.WrapkitError) as info:
        call(wm, other, tmp_path)
    # The view refuses writes with its own error (ReferenceModelError) before looking at the arguments.
    allowed = (error, wrapkit.ReferenceModelError) if "view" in repr(wm).lower() else (error,)
    assert isinstance(info.value, allowed), f"{label}: {type(info.value).__name__}: {info.value}"
    text = str(info.value)
    assert len(text) > 40, f"{label}: the message should say what to do: {text!r}"
    assert _same(before, _state(wm, other)), f"{label}: the model changed"
    left = [f for f in os.listdir(tmp_path) if f not in files and not f.startswith("bad")]
    assert not left, f"{label}: files left: {left}"
