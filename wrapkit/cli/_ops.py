"""The operations ``wrapkit doctor`` runs on every backend, one column each.

An operation is ``fn(wm, ctx) -> None`` that raises on failure. It runs on every
rank of the doctor's group, so an operation that uses collectives is entered by
all ranks. Later features add their operation here, in protocol order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._registry import as_adapter
from ._models import PRECISIONS

__all__ = ["OPS", "Op", "Refused"]

Op = Callable[[Any, dict[str, Any]], None]


class Refused(Exception):
    """Raised by an operation that the stack refuses as documented, with the typed error and nothing
    changed: reported as not applicable, with the reason, neither a pass nor a failure."""


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


def _logits(model: Any, ctx: dict[str, Any], inputs: torch.Tensor, own: bool = True) -> torch.Tensor:
    """``model``'s logits for ``inputs``. ``own``: through the backend's own forward, which for Megatron-Core
    takes positions and a mask (True: left out) and may hand out a view of a buffer it reuses; otherwise the
    model is transformers' (what ``gathered()`` holds)."""
    with torch.no_grad():
        if own and ctx["backend"] == "megatron":
            n = inputs.shape[1]
            positions = torch.arange(n, device=inputs.device).expand_as(inputs)
            masked = torch.ones(1, 1, n, n, dtype=torch.bool, device=inputs.device).triu(diagonal=1)
            return model(inputs, positions, masked).clone()  # type: ignore[no-any-return]
        out = model(inputs, **ctx["extra_inputs"])
    return out.logits if hasattr(out, "logits") else out  # type: ignore[no-any-return]


def _forward(wm: Any, ctx: dict[str, Any]) -> None:
    if ctx["no_forward"]:
        raise Refused(ctx["no_forward"])
    diff = float((_logits(wm, ctx, ctx["inputs"]).float().cpu() - ctx["expected_output"]).abs().max())
    assert diff < ctx["output_tol"], f"output differs from the unwrapped model by {diff:.2e}"


def _forward_checked(wm: Any, ctx: dict[str, Any]) -> None:
    """The forward as the last check of another operation, where the backend's forward runs here."""
    if not ctx["no_forward"]:
        _forward(wm, ctx)


def _describe(wm: Any, ctx: dict[str, Any]) -> None:
    text = wm.describe()
    assert wm.backend in text and len(text.splitlines()) >= 5


# -- placement and reference models ---------------------------------------------------
def _on_device(wm: Any, what: str) -> None:
    off = sorted({str(t.device) for _, t in as_adapter(wm).placement.tensors()} - {str(wm.device)})
    assert not off, f"{what}: tensors on {off}, expected all on {wm.device}"


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
    from .._errors import ReferenceModelError, UnsupportedModelError
    from .._wrapped import prepare_reference

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


# -- full parameters ---------------------------------------------------------------------
def _modes(wm: Any) -> list[bool]:
    return [m.training for m in wm.module.modules()]


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


# -- weights in and out ----------------------------------------------------------------
def _fresh_model(ctx: dict[str, Any], seed: int) -> torch.nn.Module:
    """The doctor's base model (seed 0 is the one every backend wrapped), unwrapped."""
    from ._families import any_model

    return any_model(ctx["model"], seed).to(ctx["device"])


def _expected(ctx: dict[str, Any], seed: int, parameters: bool = False) -> dict[str, torch.Tensor]:
    """The base model's state dict (or its parameters, tied ones under each name) in the backend's runtime
    layout: transformers' own, or the one of a backend that keeps a layout of its own (Megatron-Core)."""
    from ..formats.hub import hub_tensors

    model = _fresh_model(ctx, seed)
    layout = ctx["layout"]
    if layout is not None:  # built from the Hub's tensors (transformers may fuse them at run time)
        return dict(layout.from_hub(hub_tensors(model), ctx["names"]))
    return dict(model.named_parameters(remove_duplicate=False)) if parameters else dict(model.state_dict())


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: float = 0.0) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ ({sorted(set(got) ^ set(want))[:3]} ...)"
    bad = [k for k in want if float((got[k].double() - want[k].detach().cpu().double()).abs().max()) > tol]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[0]}"


def _full_state_dict(wm: Any, ctx: dict[str, Any]) -> None:
    sd = wm.full_state_dict(rank0_only=False)
    want = _expected(ctx, 0)
    _assert_equal(sd, want, "full_state_dict vs the unwrapped model", ctx["weight_tol"])
    assert list(sd) == list(want), "full_state_dict keys are not in state_dict() order"
    assert all(t.device.type == "cpu" for t in sd.values()), "full_state_dict returned non-CPU tensors"


@contextlib.contextmanager
def _shared_tmpdir(wm: Any) -> Iterator[str]:
    """A fresh directory made by rank 0 and known to every rank (the doctor's ranks share a machine),
    removed once every rank is done with it."""
    import shutil
    import tempfile

    import torch.distributed as dist

    distributed = as_adapter(wm).distributed and dist.is_initialized()
    obj = [tempfile.mkdtemp(prefix="wrapkit-doctor-") if wm.rank == 0 else ""]
    if distributed:
        dist.broadcast_object_list(obj, src=0)
    try:
        yield str(obj[0])
    finally:
        if distributed:
            dist.barrier()
        if wm.rank == 0:
            shutil.rmtree(obj[0], ignore_errors=True)


def _save_load(wm: Any, ctx: dict[str, Any]) -> None:
    import os

    from ..exchange.checkpoint import read_checkpoint

    original = wm.full_state_dict(rank0_only=False)
    with _shared_tmpdir(wm) as directory:
        path = os.path.join(directory, "model.safetensors")
        wm.save(path)
        _assert_equal(read_checkpoint(path), original, "the saved file")
        # Other weights in, then the file back: every weight must be restored exactly.
        wm.load_full_state_dict(_expected(ctx, 1))
        wm.load(path)
        _assert_equal(wm.full_state_dict(rank0_only=False), original, "after load")


def _save_pretrained(wm: Any, ctx: dict[str, Any]) -> None:
    """A sharded checkpoint in the Hugging Face layout, written by every rank, read back in slices."""
    import os

    original = wm.full_state_dict(rank0_only=False)
    with _shared_tmpdir(wm) as directory:
        path = os.path.join(directory, "ckpt")
        wm.save_pretrained(path, max_shard_size="16KB")
        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        assert len(files) > 1 and "model.safetensors.index.json" in os.listdir(path), f"wrote {sorted(files)}"
        wm.load_full_state_dict(_expected(ctx, 1))
        wm.load(path)
        _assert_equal(wm.full_state_dict(rank0_only=False), original, "after load of the sharded checkpoint")


def _other(wm: Any, ctx: dict[str, Any], seed: int) -> Any:
    """A model of the base model's architecture holding seed ``seed``'s weights, for ``copy_to``: the plain
    transformers model, or for a backend in a layout of its own a frozen copy of its model (same layout)."""
    from .._wrapped import adapt, prepare_reference

    if ctx["layout"] is None:
        return adapt(_fresh_model(ctx, seed))
    other = prepare_reference(wm.module, None)
    other.load_full_state_dict(_expected(ctx, seed))
    return other


def _copy_to(wm: Any, ctx: dict[str, Any]) -> None:
    original = wm.full_state_dict(rank0_only=False)
    other = _other(wm, ctx, 1)
    before = other.full_state_dict(rank0_only=False)
    wm.copy_to(other, alpha=0.5)  # EMA into a plain model
    ema = {k: before[k] * 0.5 + original[k] * 0.5 for k in original}
    _assert_equal(other.full_state_dict(rank0_only=False), ema, "EMA copy_to", tol=1e-6 + ctx["weight_tol"])
    wm.copy_to(other)
    _assert_equal(other.full_state_dict(rank0_only=False), original, "exact copy_to")
    # And into this backend: other weights in, then the original ones back (rounded to its dtype).
    _other(wm, ctx, 1).copy_to(wm)
    _assert_equal(wm.full_state_dict(rank0_only=False), before, "copy_to into this backend", ctx["weight_tol"])
    _other(wm, ctx, 0).copy_to(wm)
    _assert_equal(wm.full_state_dict(rank0_only=False), original, "restoring by copy_to", ctx["weight_tol"])


# The query and value projections as each family names them.
_ATTENTION = ("q_proj", "v_proj", "q", "v", "q_b_proj", "kv_b_proj")
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _lora(base: torch.nn.Module, seed: int, zeroed: bool) -> torch.nn.Module:
    """``base`` with LoRA on its query and value projections (and on its fused experts, PEFT's
    ``target_parameters``, where it has them), every matrix random (or zero)."""
    from peft import LoraConfig, get_peft_model

    from ._models import fill_adapters

    modules = {n.rpartition(".")[2] for n, _ in base.named_modules()}
    params = {n for n, _ in base.named_parameters()}
    experts = [t for t in _EXPERTS if any(n.endswith(t) for n in params)]
    # target_parameters only where there are experts: older PEFT releases (0.13 among them) have no such argument.
    extra: dict[str, Any] = {"target_parameters": experts} if experts else {}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[t for t in _ATTENTION if t in modules], **extra)
    return fill_adapters(get_peft_model(base, config), seed, zeroed)


def _adapters(wm: Any, ctx: dict[str, Any]) -> None:
    """This backend's PEFT stack: its adapters saved alone in PEFT's layout, loaded by PEFT onto a fresh
    base model, and resumed into zeroed adapters, every value exact."""
    import os

    import torch.distributed as dist

    from .._errors import UnsupportedModelError
    from .._imports import is_available
    from .._wrapped import adapt
    from ._models import INDEPENDENT, build

    if not ctx["has_config"] or not is_available("peft"):
        raise Refused("needs transformers and peft")
    if ctx["layout"] is not None:
        raise Refused("PEFT's LoRA goes on transformers' layers, which a Megatron-Core model does not have (PEFT "
                      "layers inside one are refused at adapt())")

    def wrapped(seed: int, zeroed: bool) -> Any:
        def wrap(spec: str, model: torch.nn.Module) -> torch.nn.Module:
            return build(spec, model=model, device=ctx["device"], precision=ctx["precision"],
                         topology=ctx["topology"])

        if ctx["backend"] == "tp":  # the plan splits plain Linear layers: PEFT goes on after it
            return adapt(_lora(wrap("tp", _fresh_model(ctx, 0)), seed, zeroed))
        return adapt(wrap(ctx["backend"], _lora(_fresh_model(ctx, 0), seed, zeroed)))

    try:
        trained = wrapped(1, zeroed=False)
    except UnsupportedModelError as exc:  # PEFT on a tensor-parallel model
        raise Refused(str(exc).split(";")[0]) from exc
    want = {k: v for k, v in trained.full_state_dict(rank0_only=False).items() if "lora_" in k}
    with _shared_tmpdir(wm) as directory:
        # One directory per model: the layouts that train a model on each half of the ranks save two.
        model = dist.get_rank() // 2 if ctx["topology"] in INDEPENDENT and dist.is_initialized() else 0
        path = os.path.join(directory, f"adapters-{model}")
        trained.save_pretrained(path, adapters_only=True)
        if trained.rank == 0:
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(_fresh_model(ctx, 0), path, autocast_adapter_dtype=False)
            got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
            _assert_equal(got, {k: v.to(got[k].dtype) if k in got else v for k, v in want.items()},
                          "PeftModel.from_pretrained of the saved adapters")
        resumed = wrapped(0, zeroed=True)
        resumed.load(path)
        got = {k: v for k, v in resumed.full_state_dict(rank0_only=False).items() if "lora_" in k}
        _assert_equal(got, want, "the adapters loaded back")


def _sleep_wake(wm: Any, ctx: dict[str, Any]) -> None:
    """The training state off the device and back: all of it on the CPU while asleep, the same values
    and modes after ``wake()``. (An engine brings its own optimizer; other backends sleep without one.)"""
    from .._errors import UnsupportedModelError
    from ..sync.sleeping import training_state

    original = wm.full_state_dict(rank0_only=False)
    modes = _modes(wm)
    try:
        report = wm.sleep()
    except UnsupportedModelError as exc:
        # Older DeepSpeed cannot move some engines' states: refused, with nothing moved.
        _on_device(wm, "a refused sleep()")
        _assert_equal(wm.full_state_dict(rank0_only=False), original, "after a refused sleep()")
        raise Refused(str(exc).split(";")[0]) from exc
    try:
        assert report.state_bytes > 0, f"sleep() reported no training state: {report}"
        off = sorted({what for what, t in training_state(as_adapter(wm), None) if t.device.type != "cpu"})
        assert not off, f"asleep, yet on the device: {off}"
    finally:
        wm.wake()
    _on_device(wm, "wake()")
    assert _modes(wm) == modes, "sleep/wake changed training flags"
    _assert_equal(wm.full_state_dict(rank0_only=False), original, "after sleep/wake")
    _forward_checked(wm, ctx)


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
