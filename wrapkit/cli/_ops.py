"""The operations ``wrapkit doctor`` runs on every backend, one column each.

An operation is ``fn(wm, ctx) -> None`` that raises on failure. It runs on every
rank of the doctor's group, so an operation that uses collectives is entered by
all ranks. Later features add their operation here, in protocol order.
"""

from __future__ import annotations

from typing import Any

import torch

from .._registry import as_adapter
from ._models import PRECISIONS
from ._op_support import (
    Op,
    Refused,
    _assert_equal,
    _expected,
    _forward,
    _forward_checked,
    _fresh_model,
    _logits,
    _modes,
    _on_device,
)
from ._ops_weights import (
    _adapters,
    _copy_to,
    _full_state_dict,
    _save_load,
    _save_pretrained,
    _sleep_wake,
)

__all__ = ["OPS", "Op", "Refused"]


def _config(wm: Any, ctx: dict[str, Any]) -> None:
    if ctx["has_config"]:
        cfg = wm.config
        assert not isinstance(cfg, dict), f"config is a {type(cfg).__name__}, the wrapper's, not the model's"
        assert cfg is wm.unwrap(keep_peft=False).config
    else:
        # A model with no config must say so with the typed error, not return something else.
        from .._errors import MissingConfigError

        try:
            _ = wm.config
        except MissingConfigError:
            return
        raise AssertionError("a model without config returned one")


def _unwrap(wm: Any, ctx: dict[str, Any]) -> None:
    inner = wm.unwrap()
    assert isinstance(inner, torch.nn.Module)
    assert type(inner).__name__ in wm.stack[-1] or wm.stack[-1] in type(inner).__name__


def _num_parameters(wm: Any, ctx: dict[str, Any]) -> None:
    n = wm.num_parameters()
    assert n == ctx["expected_parameters"], f"{n} parameters, expected {ctx['expected_parameters']}"




def _describe(wm: Any, ctx: dict[str, Any]) -> None:
    text = wm.describe()
    assert wm.backend in text and len(text.splitlines()) >= 5


def _place(wm: Any, ctx: dict[str, Any]) -> None:
    before = {n: t.detach().cpu().clone() for n, t in as_adapter(wm).placement.tensors()}
    assert wm.place("cpu") is wm
    off = [n for n, t in as_adapter(wm).placement.tensors() if t.device.type != "cpu"]
    assert not off, f"offload left tensors off the CPU: {off}"
    assert wm.place() is wm
    _on_device(wm, "place()")
    after = {n: t.detach().cpu() for n, t in as_adapter(wm).placement.tensors()}
    assert all(torch.equal(before[n], after[n]) for n in before if n in after), "the round trip changed values"
    _forward_checked(wm, ctx)


def _to_eval_frozen(wm: Any, ctx: dict[str, Any]) -> None:
    from .._gather import restore_modes

    # Freezing works in place: the doctor's model gets its modes and flags back afterwards.
    flags = [(p, p.requires_grad) for p in as_adapter(wm).placement.frozen_parameters()]
    modes = [(m, m.training) for m in wm.module.modules()]
    try:
        frozen = wm.to_eval_frozen()
        assert frozen.to_eval_frozen() is frozen, "not idempotent"
        assert not any(m.training for m in frozen.module.modules()), "a submodule is still in training mode"
        trainable = [p for p in as_adapter(frozen).placement.frozen_parameters() if p.requires_grad]
        assert not trainable, "a parameter is still trainable"
        assert frozen.is_sharded == wm.is_sharded
        _on_device(frozen, "to_eval_frozen()")
        _forward_checked(frozen, ctx)
    finally:
        restore_modes(modes)
        for p, flag in flags:
            p.requires_grad_(flag)


def _prepare_reference(wm: Any, ctx: dict[str, Any]) -> None:
    from .._adapt import prepare_reference
    from .._errors import ReferenceModelError, UnsupportedModelError

    try:
        ref = prepare_reference(wm.module, None)
    except UnsupportedModelError as exc:
        # A backend that cannot build a frozen copy says so (tensor parallelism: the plan is not kept).
        raise Refused(str(exc).split(";")[0]) from exc
    assert ref.is_sharded == wm.is_sharded, "the reference is not sharded the policy's way"
    assert ref.num_parameters(trainable_only=True) == 0, "the reference is trainable"
    _on_device(ref, "prepare_reference()")
    _forward_checked(ref, ctx)
    try:
        prepare_reference(wm.module, wm.module)
    except ReferenceModelError:
        return
    raise AssertionError("the policy itself was accepted as its own reference")


def _gathered(wm: Any, ctx: dict[str, Any]) -> None:
    modes = _modes(wm)
    with wm.gathered() as m:
        logits = _logits(m, ctx, ctx["inputs"], own=False)
    diff = float((logits.float().cpu() - ctx["expected_output"]).abs().max())
    assert diff < ctx["output_tol"], f"forward inside gathered() differs from the unwrapped model by {diff:.2e}"
    assert _modes(wm) == modes, "gathered() changed training flags"


def _generation(wm: Any, ctx: dict[str, Any]) -> None:
    modes = _modes(wm)
    inner = wm.unwrap(keep_peft=False)
    # Greedy tokens are compared for decoder-only language models; the others get the modes checked.
    can_generate = getattr(inner, "can_generate", None)
    if not ctx["has_config"] or wm.is_encoder_decoder or not (callable(can_generate) and can_generate()):
        with wm.generation() as m:
            assert not any(x.training for x in m.modules()), "generation() left modules in training mode"
        assert _modes(wm) == modes, "generation() did not restore training flags"
        return
    prompt = ctx["inputs"][:, :4]
    kwargs = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    # Greedy decoding through the backend's own forward (in its own dtype) is what generate() must match. A
    # backend in a layout of its own generates with transformers' model of the Hub layout, so that model,
    # built from the same weights in the backend's dtype, decodes the tokens to match (and only "full" holds one).
    layout = ctx["layout"] is not None
    decoder = _fresh_model(ctx, 0).to(PRECISIONS[ctx["precision"]]).eval() if layout else wm
    want = prompt
    for m in wm.module.modules():
        m.training = False
    try:
        for _ in range(kwargs["max_new_tokens"]):
            logits = _logits(decoder, ctx, want, own=not layout)
            want = torch.cat([want, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    finally:
        for m, flag in zip(wm.module.modules(), modes, strict=True):
            m.training = flag
    for gather in ("full",) if layout else ("full", "layerwise"):
        with wm.generation(gather=gather) as m:
            got = m.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        assert torch.equal(got.cpu(), want.cpu()), f"greedy tokens of gather={gather!r} differ from the backend's own"
        assert _modes(wm) == modes, f"generation(gather={gather!r}) did not restore training flags"


def _named_full_parameters(wm: Any, ctx: dict[str, Any]) -> None:
    got = {n: t.detach().cpu() for n, t in wm.named_full_parameters()}
    want = _expected(ctx, 0, parameters=True)
    _assert_equal(got, want, "named_full_parameters vs the unwrapped model", ctx["weight_tol"])


def _stream_full_parameters(wm: Any, ctx: dict[str, Any]) -> None:
    from ..integrations.vllm import load_into

    want: dict[str, torch.Tensor] = dict(_fresh_model(ctx, 0).named_parameters(remove_duplicate=False))
    receiver = _fresh_model(ctx, 1)
    # Small buckets, so that even the tiny model takes several, each gathered in one collective.
    buckets = 0
    bucket_bytes = max(t.numel() * t.element_size() for t in want.values())
    for bucket in wm.stream_full_parameters(bucket_bytes):
        buckets += 1
        load_into(receiver, [bucket])
    got = dict(receiver.named_parameters(remove_duplicate=False))
    _assert_equal({n: t.detach().cpu() for n, t in got.items()}, want, "stream_full_parameters into a fresh model",
                  ctx["weight_tol"])
    assert buckets > 1, f"stream_full_parameters({bucket_bytes}) gave {buckets} bucket for the whole model"


OPS: list[tuple[str, Op]] = [
    ("config", _config),
    ("unwrap", _unwrap),
    ("num_parameters", _num_parameters),
    ("forward", _forward),
    ("describe", _describe),
    ("place", _place),
    ("to_eval_frozen", _to_eval_frozen),
    ("prepare_reference", _prepare_reference),
    ("gathered", _gathered),
    ("generation", _generation),
    ("named_full_parameters", _named_full_parameters),
    ("stream_full_parameters", _stream_full_parameters),
    ("full_state_dict", _full_state_dict),
    ("save/load", _save_load),
    ("save_pretrained", _save_pretrained),
    ("copy_to", _copy_to),
    ("adapters", _adapters),
    ("sleep/wake", _sleep_wake),
]
