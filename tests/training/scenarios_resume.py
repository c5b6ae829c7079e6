"""Scenarios for the training state (``save_state`` / ``load_state``): a run that stops and resumes, on the
same backend or another, the same world size or another.

``trained`` takes two steps, saves, records the backend's own full view of what it saved (every fp32 weight,
every optimizer moment through torch's ``get_optimizer_state_dict``), then takes two more steps as the
uninterrupted run. ``resumed`` builds the model again from other weights, loads, and compares: the state
exactly, and where the data layout is the same, the next steps' losses and weights too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit._names import canonical_name
from wrapkit.cli._models import build

VOCAB = 128
STEPS = 2


def scheduler_of(kind: str, opt: Any) -> Any:
    """One of every scheduler torch ships, on ``opt`` (whose groups' learning rates it reads)."""
    L = torch.optim.lr_scheduler  # noqa: N806
    made: dict[str, Any] = {
        "StepLR": lambda: L.StepLR(opt, step_size=1, gamma=0.8),
        "LambdaLR": lambda: L.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)),  # a warm-up
        "MultiplicativeLR": lambda: L.MultiplicativeLR(opt, lambda s: 0.9),
        "MultiStepLR": lambda: L.MultiStepLR(opt, [1, 3], gamma=0.5),
        "ConstantLR": lambda: L.ConstantLR(opt, factor=0.5, total_iters=3),
        "LinearLR": lambda: L.LinearLR(opt, start_factor=0.25, total_iters=4),
        "ExponentialLR": lambda: L.ExponentialLR(opt, 0.9),
        "PolynomialLR": lambda: L.PolynomialLR(opt, total_iters=6, power=2.0),
        "CosineAnnealingLR": lambda: L.CosineAnnealingLR(opt, T_max=5),
        "CosineAnnealingWarmRestarts": lambda: L.CosineAnnealingWarmRestarts(opt, T_0=3),
        "CyclicLR": lambda: L.CyclicLR(opt, base_lr=[1e-3, 4e-4], max_lr=[1e-2, 4e-3], step_size_up=2,
                                       cycle_momentum=False),
        "OneCycleLR": lambda: L.OneCycleLR(opt, max_lr=[1e-2, 4e-3], total_steps=8),
        "ReduceLROnPlateau": lambda: L.ReduceLROnPlateau(opt, patience=0, min_lr=[1e-4, 4e-5]),
        "SequentialLR": lambda: L.SequentialLR(opt, [L.LinearLR(opt, 0.5, total_iters=2), L.ExponentialLR(opt, 0.9)],
                                               [2]),
        "ChainedScheduler": lambda: L.ChainedScheduler([L.LambdaLR(opt, lambda s: 1 / (s + 1)),
                                                        L.ExponentialLR(opt, 0.9)]),
    }
    return made[kind]()


def _optimizer(wm: Any, lr: float, groups: int, scheduler: str = "StepLR", reverse: bool = False) -> tuple[Any, Any]:
    """AdamW and a scheduler. ``groups=2``: norms undecayed, as trainers build it (not where FSDP1 flattens
    every parameter of a unit into one), at 0.4 of the decayed group's learning rate; ``reverse``: the groups
    listed the other way round (a trainer that builds them from a dict or a set). A DeepSpeed engine steps its own
    (torch's AdamW, one group)."""
    if wm.backend == "deepspeed":
        zero = wm.module.optimizer
        inner = getattr(zero, "optimizer", zero)  # ZeRO-0 in fp32 steps the torch optimizer itself
        for g in inner.param_groups:
            g.update(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
            g["initial_lr"] = lr
        return wm.module.optimizer, torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.8)
    named = [(n, p) for n, p in wm.module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if groups == 1 or "norm" not in n]
    rest = [p for n, p in named if groups == 2 and "norm" in n]
    listed = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.4 * lr}][:groups]
    opt = torch.optim.AdamW(listed[::-1] if reverse else listed, lr=lr, betas=(0.9, 0.95))
    return opt, scheduler_of(scheduler, opt)


def _steps(wm: Any, opt: Any, sched: Any, first: int) -> list[float]:
    losses = []
    for i in range(first, first + STEPS):
        # Each data-parallel rank its own batch, the same for a step whatever the backend.
        g = torch.Generator().manual_seed(1000 + 17 * i + wm.data_parallel_rank)
        ids = torch.randint(0, VOCAB, (2, 8), generator=g).to(wm.device)
        loss = wm(input_ids=ids, labels=ids).loss
        if wm.backend == "deepspeed":
            wm.module.backward(loss)
            wm.module.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(float(loss.detach()) + i)  # worse every step: the rates fall
        else:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


def _full_state(wm: Any, opt: Any) -> dict[str, torch.Tensor]:
    """The backend's own full view: weights (``full_state_dict``) and each moment (torch's reader)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    out = {f"model/{k}": v.float() for k, v in wm.full_state_dict(rank0_only=False).items()}
    zero = wm.module.optimizer if wm.backend == "deepspeed" else None
    if hasattr(zero, "fp32_groups") and hasattr(zero, "fp16_groups"):  # ZeRO-0's unfused 16-bit optimizer
        names = {id(p): canonical_name(n) for n, p in wm.unwrap().named_parameters()}
        for lows, highs in zip(zero.fp16_groups, zero.fp32_groups, strict=True):
            for low, high in zip(lows, highs, strict=True):
                for key, value in zero.optimizer.state[high].items():
                    out[f"optim/{names[id(low)]}/{key}"] = value.detach().cpu().clone()
        return out
    if wm.backend == "deepspeed" and hasattr(wm.module.optimizer, "optimizer"):  # DeepSpeed's own full readers
        from deepspeed.utils import safe_get_full_optimizer_state

        zero = wm.module.optimizer
        for name, p in wm.unwrap().named_parameters():
            if not p.requires_grad:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{canonical_name(name)}/{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu()
            step = next(iter(zero.optimizer.state.values()))["step"]
            out[f"optim/{canonical_name(name)}/step"] = step.detach().cpu().clone()
        return out
    osd = get_optimizer_state_dict(wm.module, opt, options=StateDictOptions(full_state_dict=True))
    for fqn, st in osd["state"].items():
        for key, value in st.items():
            v = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"optim/{canonical_name(fqn)}/{key}"] = v.detach().cpu().clone()
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _model(seed: int, lora: bool) -> torch.nn.Module | None:
    """None: the recipe's own Llama. ``lora``: LoRA on its attention, the base frozen (PEFT's own init, seeded)."""
    if not lora:
        return None
    from peft import LoraConfig, get_peft_model

    from wrapkit.cli._models import tiny_llama

    base = tiny_llama(seed)
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # type: ignore[no-any-return]


def trained(tmp: str, spec: str, precision: str = "fp32", topology: str = "flat", groups: int = 2,
            lora: bool = False, scheduler: str = "StepLR") -> dict[str, Any]:
    wm = wrapkit.adapt(build(spec, model=_model(0, lora), seed=0, precision=precision, topology=topology))
    opt, sched = _optimizer(wm, 1e-2, groups, scheduler)
    _steps(wm, opt, sched, 0)
    wm.save_state(os.path.join(tmp, "state"), opt, scheduler=sched, extra={"step": STEPS, "spec": spec})
    saved = _full_state(wm, opt)
    lr = [g["lr"] for g in opt.param_groups]
    rng = torch.rand(3)  # what this rank's generator gives next
    losses = _steps(wm, opt, sched, STEPS)
    after = {k: v.float() for k, v in wm.full_state_dict(rank0_only=False).items()}
    if dist.get_rank() == 0:
        torch.save({"saved": saved, "after": after, "lr": lr},
                   os.path.join(tmp, "reference.pt"))
    torch.save({"rng": rng, "losses": losses}, os.path.join(tmp, f"rank{dist.get_rank()}.pt"))  # each rank's own
    return {"files": sorted(os.listdir(os.path.join(tmp, "state")))}


def resumed(tmp: str, spec: str, precision: str = "fp32", topology: str = "flat",
            follow: bool = True, groups: int = 2, lora: bool = False, scheduler: str = "StepLR",
            reverse: bool = False) -> dict[str, Any]:
    """``follow``: the data layout is the one saved (same data-parallel ranks), so the next steps are
    compared with the uninterrupted run's. ``reverse``: the optimizer's groups listed the other way round."""
    ref = torch.load(os.path.join(tmp, "reference.pt"))
    wm = wrapkit.adapt(build(spec, model=_model(7, lora), seed=7, precision=precision, topology=topology))
    opt, sched = _optimizer(wm, 5e-4, groups, scheduler, reverse)
    got = wm.load_state(os.path.join(tmp, "state"), opt, scheduler=sched)
    mine = os.path.join(tmp, f"rank{dist.get_rank()}.pt")
    own = torch.load(mine) if os.path.exists(mine) else None
    obs: dict[str, Any] = {
        "extra": got.extra, "skipped": got.skipped,
        "state": _diff(_full_state(wm, opt), ref["saved"]),
        "lr": ([g["lr"] for g in opt.param_groups][::-1 if reverse else 1], ref["lr"]),
        "scheduler_epoch": sched.last_epoch,
        "rng": bool(torch.equal(torch.rand(3), own["rng"])) if own is not None else None,
    }
    if follow:
        assert own is not None
        obs["losses"] = (_steps(wm, opt, sched, STEPS), own["losses"])
        after = {k: v.float() for k, v in wm.full_state_dict(rank0_only=False).items()}
        obs["after"] = _diff(after, ref["after"])
    return obs


def _read(directory: str) -> tuple[Any, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    metadata = FileSystemReader(directory).read_metadata()
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    load(tensors, checkpoint_id=directory, no_dist=True)
    return metadata, tensors


def dcps_own_save(state: dict[str, Any], path: str, group: Any, no_dist: bool) -> None:
    """What ``save_state`` writes, written by DCP's own ``save`` (its planner, not flattening, and its writer)."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state_dict_saver.save(state, checkpoint_id=path, process_group=group, no_dist=no_dist,
                          planner=DefaultSavePlanner(flatten_state_dict=False))


def same_files(ours: str, stock: str) -> None:
    assert sorted(os.listdir(ours)) == sorted(os.listdir(stock))
    for name in os.listdir(ours):
        if name.endswith(".distcp"):
            assert os.path.getsize(os.path.join(ours, name)) == os.path.getsize(os.path.join(stock, name)), name
    (meta_a, a), (meta_b, b) = _read(ours), _read(stock)
    assert meta_a.state_dict_metadata == meta_b.state_dict_metadata
    # Every item at the same place in the same file, of the same length.
    assert {i: (s.relative_path, s.offset, s.length) for i, s in meta_a.storage_data.items()} == \
        {i: (s.relative_path, s.offset, s.length) for i, s in meta_b.storage_data.items()}
    assert a.keys() == b.keys() and len(a) > 10 and all(torch.equal(a[k], b[k]) for k in a)


def written_both_ways(tmp: str, spec: str) -> None:
    """Saves twice (the second from the first's plans), then once through DCP's own save; rank 0 compares."""
    import wrapkit.training.state as training_state

    wm = wrapkit.adapt(build(spec, seed=0))
    opt, sched = _optimizer(wm, 1e-2, 1)
    _steps(wm, opt, sched, 0)
    for name in ("ours", "again"):
        wm.save_state(os.path.join(tmp, name), opt, scheduler=sched)
    ours = training_state.write
    training_state.write = dcps_own_save
    try:
        wm.save_state(os.path.join(tmp, "stock"), opt, scheduler=sched)
    finally:
        training_state.write = ours
    if dist.get_rank() == 0:
        for name in ("ours", "again"):
            same_files(os.path.join(tmp, name), os.path.join(tmp, "stock"))


def saved_again(tmp: str, spec: str, other: str) -> dict[str, Any]:
    """Saves after each of two steps on the same ranks (the second from the plans the first made), then ``other``
    (another model, its own plans) does the same on them; ``a1``, ``b0`` and ``b1`` loaded into a model built from
    other weights: the largest difference from the state saved, per checkpoint."""
    diffs: dict[str, float] = {}
    for name, which, checked in (("a", spec, (1,)), ("b", other, (0, 1))):
        wm = wrapkit.adapt(build(which, seed=0))
        opt, sched = _optimizer(wm, 1e-2, 1)
        states = []
        for i in range(2):
            _steps(wm, opt, sched, i * STEPS)
            wm.save_state(os.path.join(tmp, f"{name}{i}"), opt, scheduler=sched)
            states.append(_full_state(wm, opt))
        for i in checked:
            again = wrapkit.adapt(build(which, seed=7))
            opt2, sched2 = _optimizer(again, 5e-4, 1)
            again.load_state(os.path.join(tmp, f"{name}{i}"), opt2, scheduler=sched2)
            diffs[f"{name}{i}"] = _diff(_full_state(again, opt2), states[i])
    return diffs


def foreign_checkpoint(tmp: str, kind: str, target: str) -> dict[str, Any]:
    """A model trained on FSDP2 by hand, its state saved as ``kind`` writes it (``torchtitan``: its
    CheckpointManager's keys, the model at the top level and the optimizer flattened per name; ``accelerate``:
    its FSDP2 save_state, model and optimizer directories), then read by ``load_state`` into ``target`` built from
    other weights: the state against the source's, and each group's learning rate."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    src = wrapkit.adapt(build("fsdp2", seed=0))
    opt, sched = _optimizer(src, 1e-2, 2)
    _steps(src, opt, sched, 0)
    for g, lr in zip(opt.param_groups, (3e-4, 7e-4), strict=True):  # each group its own, to be matched by names
        g["lr"] = lr
    where = os.path.join(tmp, f"{kind}-{target}")
    if kind == "torchtitan":
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        path = os.path.join(where, "step-2")
        save({**get_model_state_dict(src.module), "optimizer": get_optimizer_state_dict(src.module, opt, options=flat)},
             checkpoint_id=path)
    else:
        path = where
        save({"model": get_model_state_dict(src.module)}, checkpoint_id=os.path.join(where, "pytorch_model_fsdp_0"))
        save({"optimizer": get_optimizer_state_dict(src.module, opt)}, checkpoint_id=os.path.join(where, "optimizer_0"))
    want = _full_state(src, opt)
    if target == "other":  # another model's checkpoint: refused on every rank, naming what does not fit
        from wrapkit.cli._models import tiny_llama

        other = wrapkit.adapt(build("ddp", model=tiny_llama(1, layers=3)))
        try:
            other.load_state(path, _optimizer(other, 0.5, 2)[0])
        except wrapkit.StateDictError as exc:
            return {"error": str(exc)}
        return {"error": None}
    wm = wrapkit.adapt(build(target, seed=1))
    opt2, _ = _optimizer(wm, 0.5, 1 if target == "fsdp" else 2)
    before = _diff(want, _full_state(wm, opt2)) if target != "fsdp" else None
    report = wm.load_state(path, opt2)
    return {"diff": _diff(want, _full_state(wm, opt2)), "before": before, "skipped": report.skipped,
            "lrs": sorted(g["lr"] for g in opt2.param_groups)}


class _FusedQKV(torch.nn.Module):
    """torchtitan's ``FusedQKVLinear`` in small: one ``wqkv`` parameter that its ``state_dict()`` hooks save as
    ``wq`` / ``wk`` / ``wv`` and load back."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.wqkv(x).chunk(3, dim=-1))  # type: ignore[return-value]

    @staticmethod
    def _split(module: torch.nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
        for name, part in zip(("wq", "wk", "wv"), state.pop(f"{prefix}wqkv.weight").chunk(3), strict=True):
            state[f"{prefix}{name}.weight"] = part

    @staticmethod
    def _merge(module: torch.nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if f"{prefix}wq.weight" in state:
            state[f"{prefix}wqkv.weight"] = torch.cat([state.pop(f"{prefix}{n}.weight") for n in ("wq", "wk", "wv")])


def hooked_foreign_checkpoint(tmp: str) -> dict[str, Any]:
    """A model whose state-dict hooks split a parameter, saved with torchtitan's keys from FSDP2 and read into
    DDP: ``load_state`` builds the parameter through the model's load hooks (both models' full state dicts, in
    the hooks' names, compared)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    src = torch.nn.Sequential(_FusedQKV(), torch.nn.Linear(8, 8))
    fully_shard(src, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    path = os.path.join(tmp, "hooked", "step-1")
    save(src.state_dict(), checkpoint_id=path)  # the module's own: its hooks split wqkv
    want = wrapkit.adapt(src).full_state_dict(rank0_only=False)
    wm = wrapkit.adapt(build("ddp", model=torch.nn.Sequential(_FusedQKV(), torch.nn.Linear(8, 8))))
    before = wm.full_state_dict(rank0_only=False)
    wm.load_state(path)
    got = wm.full_state_dict(rank0_only=False)
    return {"keys": sorted(got), "differed": any(not torch.equal(before[k], want[k]) for k in want),
            "equal": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)}
