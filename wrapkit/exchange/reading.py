"""``load``: a safetensors file, or a directory in the Hugging Face layout (sharded with an index,
or one ``model.safetensors``), into a model on any backend, each rank reading only the byte
ranges of the parameter elements it holds.

Everything is checked before anything is written: every file opened, every name and shape
compared with the model, and the verdict agreed across ranks. Then each rank fills its pieces
(``load_pieces``: its shards, or whole parameters where unsharded) from safetensors slices of
the rows that cover them; with ``src_rank`` that rank alone reads, one tensor at a time, and
broadcasts it to the others (for nodes that do not share storage).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._agree import Call, broadcast_object, enter, models_group, raise_agreed
from .._errors import Listed, StateDictError
from .._names import model_class_name
from .._results import LoadResult
from ..adapters import Written
from ..adapters.stages.plan import layout_of
from ..base.module_internals import init_weights, own_buffers
from ..formats.safetensors import torch_dtype
from .peft import adapter_files, adapter_shapes
from .state_dict import check_entries, expected_shapes, report_skipped

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter
from .catalog import Catalog, dtype_problems

__all__ = ["load", "Catalog"]

_log = logging.getLogger(__name__.rpartition(".")[0] or __name__)




def _same_architecture(wm: Adapter, path: str) -> list[str]:
    """One line ahead of the key problems where the checkpoint's ``config.json`` names the model's own
    architecture: the keys differ because the layouts do, not the models."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    own = model_class_name(wm.unwrap(keep_peft=False))
    if own not in architectures:
        return []
    return [f"the checkpoint's config.json names this model's architecture ({own}), so its tensors are in another "
            "layout than the ones this transformers converts (the Hub's, and the runtime one): it may come from "
            "another transformers version or a converter; save it again with this transformers' save_pretrained"]








def load(wm: Adapter, path: str | os.PathLike[str], strict: bool = True, src_rank: int | None = None,
         adapter_name: str | None = None) -> LoadResult:
    """Load a checkpoint (file or directory, or a PEFT adapter directory) into ``wm``; see the module
    docstring. Collective."""
    path = os.fspath(path)
    use, group = models_group(wm)
    problems: list[str] = []
    given = src_rank
    if src_rank is not None and not (isinstance(src_rank, int) and 0 <= src_rank < wm.world_size):
        problems.append(f"src_rank={src_rank!r} is not a rank of this group of {wm.world_size}; pass None (every "
                        f"rank reads) or a rank in 0..{wm.world_size - 1}")
        src_rank = None
    if adapter_name is not None and (not isinstance(adapter_name, str) or not adapter_name):
        problems.append(f"adapter_name={adapter_name!r} is not an adapter's name; pass the name of one of the PEFT "
                        "model's adapters, or None")
        adapter_name = None
    # The path is each rank's own (nodes may hold copies at different places); how it is read is not.
    call = Call.of("load", strict=strict, src_rank=given, adapter_name=adapter_name)
    broadcast = use and src_rank is not None
    reads = not broadcast or wm.rank == src_rank
    agreed: bool | None = None
    if broadcast:  # the broadcast below is the first collective otherwise
        [agreed] = enter(call, wm, flags=[bool(problems)], invalid=1)
        if agreed:
            raise_agreed(problems, f"load {path!r} into {' > '.join(wm.stack)}", "Pass a valid src_rank.", wm,
                         agreed=True)
    # A checkpoint of the whole model may be in the Hub's layout: read under the runtime names, and a
    # tied copy may be absent.
    layout = layout_of(wm, strict=False)
    with ExitStack() as stack:
        catalog: Catalog | None = None
        entries: dict[str, tuple[tuple[int, ...], str]] = {}
        adapters: list[str] | None = None  # the PEFT adapters an adapter checkpoint holds
        mismatches: list[str] = []  # of their configs against the live ones: reported with the keys'
        if reads and not problems:
            try:
                found = adapter_files(wm, path, adapter_name)
                if found is not None:
                    adapters, problems, mismatches = found.adapters, found.problems, found.mismatches
                if not problems:
                    catalog = Catalog(path, stack, found, layout if found is None else None, expected_shapes(wm))
                    entries, mismatches = catalog.entries, mismatches + catalog.problems
            except StateDictError as exc:
                problems.append(Listed(exc))
        if broadcast:
            # The reader's verdict and headers go to every rank (also when it could not read: every
            # rank must enter the broadcast), and each checks them against its model.
            problems, entries, adapters, mismatches = broadcast_object((problems, entries, adapters, mismatches),
                                                                       src_rank or 0, group)
        meta = _on_meta(wm)
        expected: dict[str, tuple[int, ...]] = {}
        if not problems:
            shapes: dict[str, tuple[int, ...] | None] = {k: v[0] for k, v in entries.items()}
            if adapters is None:
                expected, names = expected_shapes(wm), (f"the checkpoint {path!r}", "the model")
                # Tied copies may be absent (transformers writes each tied weight once): loading what they
                # are tied to fills them.
                for name in layout.optional() if layout is not None else ():
                    if name not in entries:
                        expected.pop(name, None)
            else:
                # Only the adapters' tensors are compared, and written: the base weights stay as they are.
                expected = adapter_shapes(wm, adapters)
                names = (f"the adapter checkpoint {path!r}", "the model's adapters")
            problems = dtype_problems(entries, path)
            problems += check_entries(shapes, expected, strict, names)
            if meta is not None and adapters is not None:
                problems.append("the model was created on the meta device: load its base weights before the "
                                "adapters (wm.load(base_checkpoint)), which an adapter checkpoint does not hold")
            elif meta is not None:
                problems += _meta_problems(wm, meta, [k for k in expected if k not in entries])
        if adapters is None and any(p.startswith(("missing key", "unexpected key")) for p in problems):
            problems = _same_architecture(wm, path) + problems
        problems = mismatches + problems
        if not broadcast:
            [agreed] = enter(call, wm, flags=[bool(problems)], invalid=1)
        fix = ("Pass a checkpoint of this architecture: one that save() or save_pretrained() of such a model wrote, "
               "or transformers' own save_pretrained (the Hub's layout of a transformers model is converted); "
               "strict=False skips missing and unexpected keys, never a wrong shape.")
        if adapters is not None:
            fix = ("Pass an adapter directory saved from adapters of this configuration "
                   "(save_pretrained(adapters_only=True), or PEFT's own save_pretrained).")
        raise_agreed(problems, f"load {path!r} into {' > '.join(wm.stack)}", fix, wm,
                     agreed=None if broadcast else agreed)
        if meta is not None:
            _materialize(wm, meta)
        with torch.no_grad():
            if broadcast:
                _fill_broadcast(wm, catalog, entries, src_rank or 0, group)
            else:
                assert catalog is not None
                _fill(wm, catalog)
        wm.weights.written(Written.PIECES)
        if catalog is not None and _log.isEnabledFor(logging.DEBUG):
            _log.debug("load: rank %d read %d of the %d bytes in %s", wm.rank, catalog.bytes_read,
                       catalog.total_bytes(), path)
    return report_skipped(wm, LoadResult.of(entries, expected), "load", f"the checkpoint {path!r}")


def _fill(wm: Adapter, catalog: Catalog) -> None:
    for piece in wm.weights.pieces():
        if piece.name in catalog.entries:
            piece.write(catalog.read(piece.name, piece.start, piece.numel, piece.columns))
    for name, b in wm.named_live(parameters=False):
        if name in catalog.entries:
            b.copy_(catalog.full(name).reshape(b.shape))


def _fill_broadcast(wm: Adapter, catalog: Catalog | None, entries: dict[str, tuple[tuple[int, ...], str]],
                    src: int, group: Any) -> None:
    """One tensor at a time: the source reads it whole and broadcasts it; each rank takes its pieces."""
    pieces: dict[str, list[Any]] = {}
    for piece in wm.weights.pieces():
        pieces.setdefault(piece.name, []).append(piece)
    buffers = dict(wm.named_live(parameters=False))
    params = wm.weights.param_shapes()
    names = [n for n in entries if n in params or n in buffers]
    device = wm.device if wm.device.type != "meta" else torch.device("cpu")
    global_src = dist.get_global_rank(group, src) if group is not None else src
    for name in names:
        shape, dtype = entries[name]
        if catalog is not None:
            full = catalog.full(name).to(device).contiguous()
        else:
            known = torch_dtype(dtype)
            assert known is not None, "dtype_problems() let an unknown dtype through"
            full = torch.empty(shape, dtype=known, device=device)
        # Sent as its bytes: gloo (and NCCL for some) cannot carry every dtype a checkpoint holds,
        # float8 among them, and bytes are bytes whatever the dtype.
        dist.broadcast(full.reshape(-1).view(torch.uint8), global_src, group=group)
        for piece in pieces.get(name, ()):
            piece.write(piece.block(full))
        if name in buffers:
            buffers[name].copy_(full.reshape(buffers[name].shape))



# -- models created on the meta device -----------------------------------------------------
def _on_meta(wm: Adapter) -> list[tuple[torch.nn.Module, str]] | None:
    """None when nothing of the model is on the meta device; else its non-persistent buffers
    that are (as (module, name)): a checkpoint does not hold them, so they must be rebuilt."""
    if not any(t.is_meta for _, t in wm.placement.tensors()):
        return None
    return [(m, name) for m in wm.unwrap().modules() for name, b in own_buffers(m, persistent=False) if b.is_meta]


def _meta_problems(wm: Adapter, buffers: list[tuple[torch.nn.Module, str]], missing: list[str]) -> list[str]:
    problems = [f"{name!r} is not in the checkpoint, and the model was created on the meta device: it would be "
                "left uninitialized" for name in missing]
    inner = wm.unwrap(keep_peft=False)
    if buffers and init_weights(inner) is None:
        problems.append(f"the model was created on the meta device with non-persistent buffers "
                        f"({', '.join(n for _, n in buffers[:3])}) that no checkpoint holds and that only a "
                        "transformers model can rebuild; create those on a real device")
    return problems


def _materialize(wm: Adapter, buffers: list[tuple[torch.nn.Module, str]]) -> None:
    """Storage for this rank's shards on the compute device (FSDP2 allocates only the local
    shards), then the non-persistent buffers rebuilt the way transformers builds them."""
    device = wm.device
    wm.module.to_empty(device=device)
    init: Any = init_weights(wm.unwrap(keep_peft=False))
    with torch.no_grad():
        for module in dict.fromkeys(m for m, _ in buffers):
            init(module)  # for rotary embeddings: inv_freq from the config
