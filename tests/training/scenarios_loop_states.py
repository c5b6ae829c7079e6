"""Every read/write operation from the states a training loop leaves a model in.

An online RL loop calls wrapkit between the pieces of a step, not only on a fresh model:
- ``"no_grad_forward"``: right after a log-prob pass under ``no_grad`` (FSDP2 keeps the root's
  parameters unsharded then, ZeRO-3 keeps what it fetched);
- ``"train_forward"``: right after a forward that built a graph, before its backward;
- ``"between_backward_and_step"``: gradients ready, the optimizer step not taken yet.

Each case puts one model in one state, runs every operation, checks each result against the
weights read in a clean state just before, then finishes the training step and checks the step
still runs and moves the weights. A state an operation cannot handle must raise a typed
``WrapkitError``; anything else (or a crash) fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import build, tiny_llama
from wrapkit.cli._workers import next_case
from wrapkit.integrations.vllm import load_into

TOKENS = torch.arange(16).reshape(2, 8) % 128
STATES = ("no_grad_forward", "train_forward", "between_backward_and_step")
BUCKET = 20_000  # several buckets for the tiny model
OPS = ("gathered", "generation", "named_full_parameters", "full_state_dict", "stream_full_parameters", "copy_to",
       "save_pretrained+load")
# A PEFT stack's own: its adapters saved alone and loaded back (the operations above run on the bare ones).
PEFT_OPS = ("full_state_dict", "save_adapters+load")
# Real models register empty tensors (DeepSpeed PR #8375 reports such parameters); one of each kind on a layer.
EMPTY_PARAMETER, EMPTY_BUFFER = "model.layers.0.mlp.empty", "model.layers.0.mlp.empty_buffer"


def _model(seed: int, empty: bool = True) -> torch.nn.Module:
    """The tiny Llama with a zero-element parameter and a zero-element buffer on its first MLP (``empty``). The
    parameter is frozen: FSDP2's reduce-scatter cannot take an empty gradient (torch's ``_chunk_cat`` refuses it)."""
    model = tiny_llama(seed)
    if empty:
        mlp = model.model.layers[0].mlp
        mlp.register_parameter("empty", torch.nn.Parameter(torch.empty(0), requires_grad=False))
        mlp.register_buffer("empty_buffer", torch.zeros(0))
    return model


def has_empty(spec: str) -> bool:
    """DeepSpeed's ZeRO-3 fails its own forward on a zero-element parameter (its fetch asserts the parameter is
    available; DeepSpeed PR #8375): those cases go without."""
    return "zero3" not in spec


class _Step:
    """A training step cut into its pieces, the same for a DeepSpeed engine and a torch optimizer."""

    def __init__(self, wm: Any) -> None:
        self.wm = wm
        self.engine = wm.backend == "deepspeed"
        params = [p for p in wm.module.parameters() if p.requires_grad]
        self.opt = None if self.engine else torch.optim.SGD(params, lr=0.1)
        self.loss: torch.Tensor | None = None

    def forward(self) -> None:
        self.loss = self.wm(input_ids=TOKENS.to(self.wm.device), labels=TOKENS.to(self.wm.device)).loss

    def backward(self) -> None:
        assert self.loss is not None
        if self.engine:
            self.wm.module.backward(self.loss)
        else:
            self.loss.backward()
        self.loss = None

    def step(self) -> None:
        if self.engine:
            self.wm.module.step()
        else:
            assert self.opt is not None
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def _enter(state: str, step: _Step) -> Callable[[], None]:
    """Put the model in ``state``; return what finishes the training step from there."""
    if state == "no_grad_forward":
        with torch.no_grad():
            step.wm(input_ids=TOKENS.to(step.wm.device))

        def finish() -> None:
            step.forward()
            step.backward()
            step.step()
        return finish
    step.forward()
    if state == "train_forward":
        def finish_train() -> None:
            step.backward()
            step.step()
        return finish_train
    assert state == "between_backward_and_step"
    step.backward()
    return step.step


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rounded: bool = False) -> list[str]:
    """Names whose value differs (or is missing) in ``got``. ``rounded``: ``got`` may hold the
    values in a narrower dtype (what the backend computes in), compared after rounding ``want``."""
    def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
        a = a.detach().cpu()
        if rounded:
            return torch.equal(a, b.to(a.dtype))
        return a.dtype == b.dtype and torch.equal(a, b)
    return [n for n in want if n not in got or not equal(got[n], want[n])] + sorted(set(got) - set(want))


def _ops(wm: Any, want: dict[str, torch.Tensor], tmp: str) -> dict[str, Callable[[], list[str]]]:
    """Every operation, each giving [] when right or the names it got wrong."""
    parameters = {n: v for n, v in want.items() if n != EMPTY_BUFFER}  # what the parameter readers give

    def gathered() -> list[str]:
        with wm.gathered() as m:
            return _same(dict(m.named_parameters(remove_duplicate=False)), parameters, rounded=True)

    def generation() -> list[str]:
        training = [m.training for m in wm.unwrap().modules()]
        with wm.generation() as m:
            out = m.generate(TOKENS[:1, :4].to(wm.device), max_new_tokens=3, do_sample=False)
        restored = [m.training for m in wm.unwrap().modules()] == training
        return ([] if out.shape[-1] == 7 else ["length"]) + ([] if restored else ["modes"])

    def stream() -> list[str]:
        streamed: dict[str, torch.Tensor] = {}
        for bucket in wm.stream_full_parameters(BUCKET):
            streamed.update((n, t.clone()) for n, t in bucket.named_tensors())
        # And into a model, as an inference engine takes them.
        receiver = _model(99, EMPTY_PARAMETER in want)
        load_into(receiver, wm.stream_full_parameters(BUCKET))
        got = dict(receiver.named_parameters(remove_duplicate=False))
        into_model = [n for n in streamed if not torch.equal(got[n], streamed[n].to(got[n].dtype))]
        return _same(streamed, parameters, rounded=True) + into_model

    def copy_to() -> list[str]:
        target = wrapkit.adapt(_model(98, EMPTY_PARAMETER in want))
        wm.copy_to(target)
        return _same(target.full_state_dict(), want)

    def save_and_load() -> list[str]:
        directory = os.path.join(tmp, "pretrained")
        wm.save_pretrained(directory)
        wm.load(directory)  # the same values back: nothing may change
        return _same(wm.full_state_dict(rank0_only=False), want)

    def adapters() -> list[str]:
        directory = os.path.join(tmp, "adapters")
        wm.save_pretrained(directory, adapters_only=True)
        wm.load(directory)  # the same adapters back: nothing may change
        return _same(wm.full_state_dict(rank0_only=False), want)

    return {"gathered": gathered, "generation": generation, "save_adapters+load": adapters,
            "named_full_parameters": lambda: _same(dict(wm.named_full_parameters()), parameters),
            "full_state_dict": lambda: _same(wm.full_state_dict(rank0_only=False), want),
            "stream_full_parameters": stream, "copy_to": copy_to, "save_pretrained+load": save_and_load}


def loop_states(spec: str, precision: str = "fp32", topology: str = "flat") -> dict[str, Any]:
    """Every state of ``STATES`` in turn on one model of ``spec``; observations per state."""
    wm = wrapkit.adapt(build(spec, model=_model(7, has_empty(spec)), precision=precision, topology=topology))
    step = _Step(wm)
    # One directory per model, named by rank 0: save_pretrained is written by the model's ranks
    # together. A model that is not distributed is one model per rank; the "subgroup" and
    # "submesh" layouts hold one model per half of the ranks.
    names = [tempfile.mkdtemp(prefix="wk-states-") if not dist.is_initialized() or dist.get_rank() == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    root = names[0]
    out = _through_states(wm, step, names, spec, topology)
    if dist.is_initialized():  # every rank is done with the directory
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _through_states(wm: Any, step: Any, names: list[str], spec: str, topology: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if dist.is_initialized():
        rank = dist.get_rank()
        model = rank if wm.world_size == 1 else rank // 2 if topology in ("subgroup", "submesh") else 0
        names[0] = os.path.join(names[0], f"model-{model}")
        os.makedirs(names[0], exist_ok=True)
    tmp = names[0]
    # Each operation from a fresh entry into each state (an operation may leave the model in
    # another one), compared with the weights read in a clean state just before: fresh, or
    # right after a step. The step that finishes each entry must still run and move the weights.
    want = wm.full_state_dict(rank0_only=False)
    # By the end of their names: a PEFT model's own names carry its prefixes.
    out["empty_tensors"] = sorted(e for e in (EMPTY_PARAMETER, EMPTY_BUFFER)
                                  if any(n.endswith(e.partition(".")[2]) and v.numel() == 0 for n, v in want.items()))
    for state in STATES:
        obs: dict[str, Any] = {}
        moved = []
        for op in PEFT_OPS if "peft" in spec else OPS:
            finish = _enter(state, step)
            try:
                obs[op] = _ops(wm, want, tmp)[op]()
            except wrapkit.WrapkitError as exc:  # a typed refusal: reported, the test decides
                obs[op] = f"{type(exc).__name__}: {exc}"
            finish()
            after = wm.full_state_dict(rank0_only=False)
            moved.append(any(not torch.equal(after[n], want[n]) for n in want))
            want = after
        obs["step_moved_weights"] = all(moved)
        out[state] = obs
    with torch.no_grad():
        loss = wm(input_ids=TOKENS.to(wm.device), labels=TOKENS.to(wm.device)).loss
    out["loss_finite"] = bool(torch.isfinite(loss).item())
    return out


def loop_state_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``loop_states`` in one call, keyed by their arguments."""
    out = {}
    for c in cases:
        out[repr(sorted(c.items()))] = loop_states(**c)
        next_case()
    return out
