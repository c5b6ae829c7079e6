"""Weights in and out: full state dicts, safetensors checkpoints and name-aligned copies.

Names are canonical (:func:`canonical_name`): the keys of ``wm.unwrap().state_dict()``,
whatever wraps the model. A full state dict holds every parameter *and every persistent
buffer* (exactly the keys ``state_dict()`` of the unwrapped model has; non-persistent
buffers such as rotary caches are left out, as ``state_dict()`` leaves them out), as CPU
tensors. Parameters are read through ``wm.named_full_parameters()`` (one gathered at a
time) and written inside ``wm.gathered(modifier_rank=0)``, so the backends' own gather
and write-back are used; buffers are never sharded by any backend and are read and
written where they are.

Every check that could fail on one rank only (a key mismatch, an unreadable file, a
failed write on rank 0) is agreed on across the model's group before any collective
starts, so an error is raised on every rank and no rank is left waiting.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._errors import StateDictError, UnsupportedModelError
from ._gather import agree_flags
from ._imports import is_instance, require
from ._names import canonical_name
from .layers.peft import base_key_map

if TYPE_CHECKING:
    from .adapters._base import Adapter

__all__ = [
    "full_state_dict", "load_full_state_dict", "save", "load", "copy_to", "read_checkpoint", "copy_stream_to",
    "write_checkpoint", "expected_shapes", "source_stream",
]

Shape = tuple[int, ...]


# -- agreement across ranks ------------------------------------------------------------
def _collective(*wms: Adapter) -> tuple[bool, Any]:
    """Whether a collective is needed for these models, and over which group.

    Non-distributed backends (plain, DataParallel) never enter a collective: a user may
    save a plain model from rank 0 alone while a process group exists.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    for wm in wms:
        if wm.distributed:
            return True, wm.process_group()
    return False, None


def _any_ranks(flags: list[bool], *wms: Adapter) -> list[bool]:
    """Each flag OR-ed over the group of ``wms``, in one collective (the flags themselves
    when no collective applies)."""
    use, group = _collective(*wms)
    return agree_flags(flags, group) if use else list(flags)


def _any_rank(flag: bool, *wms: Adapter) -> bool:
    """``flag`` OR-ed over the group of ``wms`` (just ``flag`` when no collective applies)."""
    return _any_ranks([flag], *wms)[0]


def _raise_agreed(problems: list[str], what: str, fix: str, *wms: Adapter, agreed: bool | None = None) -> None:
    """Raise on every rank if any rank found a problem; the local list when there is one.

    ``agreed``: the OR of ``bool(problems)`` over the ranks, when the caller already has it."""
    if not (_any_rank(bool(problems), *wms) if agreed is None else agreed):
        return
    use, group = _collective(*wms)
    if use:
        # Every rank reports every rank's problems (they are usually the same list).
        lists: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, problems, group=group)
        if all(x == lists[0] for x in lists):
            problems = list(lists[0])
        else:
            problems = [f"rank {r}: {p}" for r, lst in enumerate(lists) for p in lst]
    listing = "\n  ".join(problems)
    raise StateDictError(f"{what}: {len(problems)} problem(s), nothing was written:\n  {listing}\n{fix}")


# -- names, shapes and live tensors ----------------------------------------------------
def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _live_entries(
    root: torch.nn.Module, *, parameters: bool = True, buffers: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every key ``root.state_dict()`` has, in its order.

    Parameters (tied ones under each of their names) and persistent buffers, module by
    module; ``parameters`` / ``buffers`` select which.
    """
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        if parameters:
            for name, p in mod._parameters.items():
                if p is not None:
                    yield canonical_name(_join(mod_name, name)), p
        if buffers:
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent_buffers_set:
                    yield canonical_name(_join(mod_name, name)), b


def _live_parameters(root: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return _live_entries(root, buffers=False)


def _live_buffers(root: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return _live_entries(root, parameters=False)


def expected_shapes(wm: Adapter) -> dict[str, Shape]:
    """Canonical name -> full shape of every state-dict entry, read without gathering anything."""
    out = wm.param_shapes()
    out.update((name, tuple(b.shape)) for name, b in _live_buffers(wm.unwrap()))
    return out


def _shapes_of(sd: Mapping[str, Any]) -> dict[str, Shape | None]:
    """Shape of each entry; ``None`` for a value that is not a tensor."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def _check(given: Mapping[str, Shape | None], expected: Mapping[str, Shape], strict: bool,
           names: tuple[str, str] = ("the state dict", "the model")) -> list[str]:
    """Every missing, unexpected, mis-shaped or non-tensor entry of ``given``, one line each."""
    ours, theirs = names
    problems: list[str] = []
    if strict:
        problems += [f"missing key {k!r}: in {theirs} (shape {list(v)}), not in {ours}"
                     for k, v in expected.items() if k not in given]
        problems += [f"unexpected key {k!r}: in {ours}, not in {theirs}" for k in given if k not in expected]
    for key, shape in given.items():
        if key not in expected:
            continue
        if shape is None:
            problems.append(f"{key!r} in {ours} is not a tensor")
        elif shape != expected[key]:
            problems.append(f"{key!r} has shape {list(shape)} in {ours}, {list(expected[key])} in {theirs}")
    return problems


# -- reading ---------------------------------------------------------------------------
def full_state_dict(wm: Adapter, rank0_only: bool = True, *, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer under its canonical name, as CPU tensors.

    Every rank must call it (sharded backends gather); with ``rank0_only`` the other
    ranks get ``{}``. ``merge_adapters=True`` on a PEFT model returns the base model's
    weights with the LoRA adapters folded in, under the base model's names; the live
    model is not changed.
    """
    if merge_adapters:
        # Validate before any gather: an unsupported PEFT layer must fail on every rank alike.
        plan = _lora_fold_plan(wm)
    keep = not rank0_only or wm.rank == 0
    out: dict[str, torch.Tensor] = {}
    # Tied parameters come once per name; they stay one tensor, as in state_dict().
    owner = {name: id(p) for name, p in _live_parameters(wm.unwrap())}
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, full in wm.named_full_parameters():
            if not keep:
                continue
            key = owner.get(name)
            if key is not None and key in copies:
                out[name] = copies[key]
                continue
            # A fresh CPU copy: the gathered buffer is reused or freed after this step.
            out[name] = full.detach().to("cpu", copy=True).contiguous()
            if key is not None:
                copies[key] = out[name]
        if keep:
            for name, b in _live_buffers(wm.unwrap()):
                out[name] = b.detach().to("cpu", copy=True).contiguous()
    if not keep:
        return out
    # Key order of the unwrapped model's own state_dict(): per module, its parameters then its buffers.
    order = dict.fromkeys(name for name, _ in _live_entries(wm.unwrap()))
    out = {k: out[k] for k in order if k in out} | {k: v for k, v in out.items() if k not in order}
    if merge_adapters and plan is not None:
        out = _fold_lora(out, plan)
    return out


# -- PEFT merge ------------------------------------------------------------------------
class _LoraFoldPlan:
    """What ``merge_adapters`` needs to know of the live PEFT model, read without touching it:
    how its keys map to the base model's, and the LoRA layers to fold."""

    def __init__(self, rename: Callable[[str], str | None], layers: list[tuple[str, Any]]) -> None:
        self.rename = rename
        self.layers = layers


def _lora_fold_plan(wm: Adapter) -> _LoraFoldPlan | None:
    peft_root = wm.unwrap(keep_peft=True)
    if peft_root is wm.unwrap(keep_peft=False):
        return None  # no PEFT layer: nothing to merge
    layers: list[tuple[str, Any]] = []
    problems: list[str] = []
    for mod_name, mod in peft_root.named_modules():
        if not is_instance(mod, "peft.tuners.tuners_utils", "BaseTunerLayer"):
            if is_instance(mod, "peft.utils.other", "ModulesToSaveWrapper"):
                problems.append(f"{canonical_name(mod_name)}: modules_to_save copies")
            continue
        name = canonical_name(mod_name)
        if not is_instance(mod, "peft.tuners.lora.layer", "Linear"):
            problems.append(f"{name}: {type(mod).__module__}.{type(mod).__name__}")
            continue
        for adapter in mod.active_adapters:
            if mod.use_dora.get(adapter) or mod.lora_bias.get(adapter):
                problems.append(f"{name}: adapter {adapter!r} uses DoRA or a LoRA bias")
        layers.append((name, mod))
    if problems:
        raise UnsupportedModelError(
            "full_state_dict(merge_adapters=True) folds in LoRA adapters of Linear layers only; this model has "
            + "; ".join(problems)
            + ". Export with merge_adapters=False, or merge with PEFT's merge_and_unload() on an unsharded copy."
        )
    return _LoraFoldPlan(base_key_map(peft_root), layers)


def _fold_lora(sd: dict[str, torch.Tensor], plan: _LoraFoldPlan) -> dict[str, torch.Tensor]:
    """``sd`` of the PEFT model -> the base model's state dict with the adapters folded in."""
    folded: dict[str, torch.Tensor] = {}
    for name, mod in plan.layers:
        key = f"{name}.base_layer.weight"
        weight = sd[key]
        if not mod.merged and not mod.disable_adapters:
            acc = weight.float()
            for adapter in mod.active_adapters:
                if adapter not in mod.lora_A:
                    continue
                a = sd[f"{name}.lora_A.{adapter}.weight"].float()
                b = sd[f"{name}.lora_B.{adapter}.weight"].float()
                delta = b @ a
                if mod.fan_in_fan_out:
                    delta = delta.T
                acc = acc + delta * mod.scaling[adapter]
            weight = acc.to(weight.dtype)
        folded[key] = weight.contiguous()
    return {new: folded.get(key, value) for key, value in sd.items() if (new := plan.rename(key)) is not None}


# -- writing ---------------------------------------------------------------------------
def _assign(dst: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
    if alpha == 1.0 or not dst.is_floating_point():
        dst.copy_(src)
        return
    # target = alpha*source + (1-alpha)*target, accumulated in float32 whatever the dtypes.
    s = src.to(device=dst.device, dtype=torch.float32)
    d = dst.to(torch.float32)
    dst.copy_(d * (1.0 - alpha) + s * alpha)


def _write_into(root: torch.nn.Module, values: Iterable[tuple[str, torch.Tensor]], alpha: float) -> None:
    live: dict[str, torch.Tensor] = dict(_live_parameters(root))
    live.update(_live_buffers(root))
    done: set[int] = set()
    with torch.no_grad():
        for name, value in values:
            dst = live.get(name)
            if dst is None or id(dst) in done:
                continue
            done.add(id(dst))
            _assign(dst, value, alpha)


def _write(target: Adapter, values: Iterable[tuple[str, torch.Tensor]], alpha: float) -> None:
    """Write ``values`` (canonical name -> full tensor) into ``target``'s parameters and buffers."""
    if not target.distributed:
        # Its parameters are full and local to this process, which may be the only one
        # calling (rank 0 loading a plain copy): no collective may be entered.
        _write_into(target.unwrap(), values, alpha)
        target.weights_written()
        return
    # modifier_rank=0: every rank writes the same values and rank 0's reach every shard,
    # replica and optimizer master copy on exit (gathered() refreshes those itself).
    with target.gathered(modifier_rank=0) as root:
        _write_into(root, values, alpha)


def load_full_state_dict(wm: Adapter, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full (unsharded, canonically named) state dict into ``wm`` on any backend.

    Every rank must call it with the same ``sd``. Missing, unexpected (when ``strict``)
    and mis-shaped keys raise one ``StateDictError`` listing all of them before anything
    is written.
    """
    problems: list[str] = []
    if not isinstance(sd, Mapping):
        problems.append(f"expected a mapping of name -> tensor, got {type(sd).__name__}")
    if not problems:
        problems = _check(_shapes_of(sd), expected_shapes(wm), strict)
    _raise_agreed(problems, f"load_full_state_dict into {' > '.join(wm.stack)}",
                  "Pass a full state dict of this architecture (the keys of wm.full_state_dict()), the same on "
                  "every rank; strict=False skips missing and unexpected keys, never a wrong shape.", wm)
    _write(wm, sd.items(), 1.0)


def _copy_problems(alpha: float, same: str | None) -> list[str]:
    """What is wrong with copy_to's arguments themselves; ``same``: why the target is the source."""
    problems: list[str] = []
    if not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        problems.append(f"alpha must be a number in [0, 1], got {alpha!r}")
    if same is not None:
        problems.append(same)
    return problems


_COPY_FIX = ("copy_to matches weights by canonical name: source and target must be the same architecture, "
             "with the same PEFT layers, and alpha in [0, 1].")


def copy_to(source: Adapter, target: Adapter, alpha: float = 1.0) -> None:
    """``target = alpha * source + (1 - alpha) * target`` for every parameter and persistent buffer.

    Matched by canonical name; any backend to any backend. Integer buffers are copied.
    ``requires_grad`` and training flags of the target are not touched.
    """
    same = target is source or target.module is source.module
    problems = _copy_problems(
        alpha, "the target is the source model itself; pass another model (e.g. the reference)" if same else None)
    pairs = None if problems else _shard_pairs(source, target)
    if not problems:
        # Same parameter names and shard layouts imply the same shapes: then only the
        # buffers need checking, which keeps a frequent soft update cheap.
        if pairs is None:
            src: dict[str, Shape | None] = dict(expected_shapes(source))
            problems = _check(src, expected_shapes(target), True, ("the source", "the target"))
        else:
            src_buffers = dict(_live_buffers(source.unwrap()))
            tgt_buffers = dict(_live_buffers(target.unwrap()))
            problems = _check({n: tuple(b.shape) for n, b in src_buffers.items()},
                              {n: tuple(b.shape) for n, b in tgt_buffers.items()}, True, ("the source", "the target"))
            pairs += [(tgt_buffers[n], b) for n, b in src_buffers.items() if n in tgt_buffers]
    # One collective agrees on both: whether any rank found a problem, and whether every
    # rank can take the shard-to-shard path (which has no collective; the general one has many).
    any_problem, any_slow = _any_ranks([bool(problems), pairs is None], source, target)
    _raise_agreed(problems, f"copy_to from {' > '.join(source.stack)} to {' > '.join(target.stack)}",
                  _COPY_FIX, source, target, agreed=any_problem)
    if not any_slow:
        assert pairs is not None
        with torch.no_grad():
            for dst, src_tensor in pairs:  # shards, then the (unsharded) buffers
                _assign(dst, src_tensor, float(alpha))
        target.shards_written()
        target.weights_written()
        return
    _write(target, source_stream(source), float(alpha))


def copy_stream_to(group: Adapter, source: str, shapes: Mapping[str, Shape], stream: Iterable[tuple[str, torch.Tensor]],
                   target: Adapter, alpha: float = 1.0, same: str | None = None) -> None:
    """``copy_to`` from a source that is not an adapter of its own (a view over ``group``'s
    model): ``shapes`` are its full shapes by name, ``stream`` its full tensors, gathered
    lazily. ``same``: set when the target is the model the source is a view of."""
    problems = _copy_problems(alpha, same)
    if not problems:
        problems = _check(dict(shapes), expected_shapes(target), True, ("the source", "the target"))
    _raise_agreed(problems, f"copy_to from {source} to {' > '.join(target.stack)}", _COPY_FIX, group, target)
    _write(target, stream, float(alpha))


def _shard_pairs(source: Adapter, target: Adapter) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(target shard, source shard) for every parameter when both models hold the same slice of
    each parameter on this rank (ZeRO-3 to ZeRO-3, FSDP2 to FSDP2 over the same ranks): a sync is
    then a local copy, with nothing gathered. ``None`` when the layouts differ anywhere."""
    src, dst = source.local_shards(), target.local_shards()
    if src is None or dst is None or src.keys() != dst.keys():
        return None
    pairs = []
    for name, (d, d_key) in dst.items():
        s, s_key = src[name]
        if s_key != d_key or s.shape != d.shape:
            return None
        pairs.append((d, s))
    return pairs


def source_stream(source: Adapter) -> Iterator[tuple[str, torch.Tensor]]:
    yield from source.named_full_parameters()
    yield from _live_buffers(source.unwrap())


# -- files -----------------------------------------------------------------------------
def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(sd: Mapping[str, torch.Tensor], path: str) -> None:
    st = require("safetensors.torch", feature="saving a safetensors checkpoint", extra="transformers")
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # safetensors refuses tensors that share memory (tied weights): give each key its own.
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        tensors[key] = t.clone() if ptr in seen else t
        if ptr != -1:
            seen.add(ptr)
    try:
        # A file created by open() gets the usual permissions (umask applied); safetensors
        # leaves its output readable by the owner only, so that mode is put back after.
        with open(tmp, "xb"):
            pass
        mode = os.stat(tmp).st_mode & 0o777
        st.save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        # The rename is the commit point: ``path`` holds either the old file or the whole new one.
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def save(wm: Adapter, path: str | os.PathLike[str]) -> None:
    """Write the full state dict to one safetensors file, atomically, from rank 0.

    Every rank must call it. Rank 0 writes a temporary file in the same directory,
    fsyncs it and renames it over ``path``, so an interrupted save never leaves a
    partial file at ``path``. Returns on every rank once the file is in place.
    """
    write_checkpoint(wm, path, lambda: full_state_dict(wm, rank0_only=True))


def write_checkpoint(group: Adapter, path: str | os.PathLike[str],
                     state: Callable[[], dict[str, torch.Tensor]]) -> None:
    """``save`` of the state dict that ``state()`` returns (collective over ``group``'s ranks;
    full on its rank 0, ``{}`` elsewhere): checked, written and agreed on as ``save`` says."""
    path = os.fspath(path)
    writer = group.rank == 0
    problems: list[str] = []
    if writer:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            problems.append(f"directory {directory!r} does not exist; create it first")
        elif os.path.isdir(path):
            example = os.path.join(path, "model.safetensors")
            problems.append(f"{path!r} is a directory; pass a file path such as {example!r}")
    _raise_agreed(problems, f"save to {path!r}", "Pass the path of a file in an existing directory.", group)
    sd = state()
    error: BaseException | None = None
    if writer:
        try:
            _atomic_write(sd, path)
        except Exception as exc:
            error = exc
    if _any_rank(error is not None, group):
        cause = f"{type(error).__name__}: {error}" if error is not None else "see rank 0's error"
        raise StateDictError(
            f"rank 0 could not write {path!r} ({cause}); any earlier file there is untouched and the "
            "temporary file was removed. Check the free space and permissions of that directory."
        ) from error


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a safetensors file into CPU tensors; ``StateDictError`` if it is missing, truncated or corrupt."""
    path = os.fspath(path)
    st = require("safetensors.torch", feature="loading a safetensors checkpoint", extra="transformers")
    if not os.path.isfile(path):
        raise StateDictError(f"no checkpoint file at {path!r}; pass the path that save() wrote")
    try:
        sd: dict[str, torch.Tensor] = st.load_file(path, device="cpu")
    except Exception as exc:  # safetensors raises its own error type (and OSError for I/O)
        raise StateDictError(
            f"{path!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); it is truncated or "
            "corrupt. Save it again, or load an earlier checkpoint."
        ) from exc
    return sd


def load(wm: Adapter, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load a file written by :func:`save` (or any safetensors file with canonical names) into ``wm``.

    Every rank must call it and reads the file itself.
    """
    sd: dict[str, torch.Tensor] = {}
    error: StateDictError | None = None
    try:
        sd = read_checkpoint(path)
    except StateDictError as exc:
        error = exc
    if _any_rank(error is not None, wm):
        raise error or StateDictError(f"another rank could not read {os.fspath(path)!r} (see its error)")
    load_full_state_dict(wm, sd, strict=strict)
