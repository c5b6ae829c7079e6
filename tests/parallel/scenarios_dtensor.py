"""DTensors of every ``Shard``/``Replicate`` placement on 1-D and 2-D meshes, uneven sizes included:
``adapters/dtensor/layout.py`` gathers, writes back and loads each exactly, batched where it says it does."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wrapkit.adapters.dtensor import layout as _dtensor
from wrapkit.adapters.dtensor import local as _local

SHAPES = [(5, 3), (3, 7), (1, 4), (6,), (4, 4)]


def _placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def _served(params: list[Any], dtypes: dict[int, torch.dtype]) -> tuple[dict[int, torch.Tensor], int]:
    """``full_values`` of ``params`` by id, and how many all-gathers it made."""
    gathers = [0]
    real = _dtensor.all_gather_into

    def counted(*args: Any, **kwargs: Any) -> None:
        gathers[0] += 1
        real(*args, **kwargs)

    _dtensor.all_gather_into = counted  # type: ignore[assignment]
    try:
        served = dict((id(p), full) for p, full in _dtensor.full_values(params, dtypes))
    finally:
        _dtensor.all_gather_into = real  # type: ignore[assignment]
    return served, gathers[0]


def layouts(mesh_shape: list[int], placements: list[str], dtype: str = "float32") -> list[str]:
    """Problems found (empty: none) for ``placements`` (``"S0"``, ``"S1"``, ``"R"`` per mesh dimension)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    places = [_placement(p) for p in placements]
    problems: list[str] = []
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in SHAPES]
    # A placement that shards a dimension the tensor lacks is skipped (1-D tensors and Shard(1)).
    pairs = [(f, distribute_tensor(f, mesh, places)) for f in fulls
             if all(not x.is_shard() or x.dim < f.dim() for x in places)]
    params = [d for _, d in pairs]
    want = getattr(torch, dtype)
    dtypes = {id(d): want for d in params}

    served, gathers = _served(params, dtypes)
    # One all-gather for every parameter split over the same mesh dimensions, however many there are.
    sharded = int(any(x.is_shard() for x in places))
    if gathers != sharded:
        problems.append(f"{gathers} all-gathers for {len(params)} parameters, expected {sharded}")
    for full, d in pairs:
        got = served.get(id(d))
        if got is None:
            problems.append(f"{tuple(full.shape)}: not served")
        elif got.dtype != want or not torch.equal(got, full.to(want)):
            problems.append(f"{tuple(full.shape)}: gathered value differs")
        if not torch.equal(_dtensor.full_value(d), full):
            problems.append(f"{tuple(full.shape)}: full_value differs")

    layout = _dtensor.Layout.of(params[0])
    if layout.shard_dims != tuple(i for i, x in enumerate(places) if x.is_shard()):
        problems.append(f"layout {layout}")

    # Written back: only the writer of the first copy holds the new value (other copies' writers
    # another, every other rank garbage); that value ends up everywhere.
    index = 0  # this rank's index over the shard dimensions, row-major
    for i in layout.shard_dims:
        index = index * mesh.size(i) + mesh.get_local_rank(i)
    first_copy = all(mesh.get_local_rank(i) == 0 for i in layout.replica_dims)
    size = mesh.size() // _replicas(mesh, layout)
    for writer in sorted({0, size - 1}):
        for full, d in pairs:
            new = full * 10 + writer
            mine = new if index == writer and first_copy else new + 100 + dist.get_rank()
            _dtensor.write_full(d, mine, writer, layout.shard_group(), layout.replica_groups())
            if not torch.equal(d.full_tensor(), new):
                problems.append(f"{tuple(full.shape)}: written from {writer}, read back differs")

    # Loaded piece by piece: each rank writes its slice from the full value.
    for full, d in pairs:
        piece = _local.load_piece("w", d)
        if piece is not None:
            piece.write(full.reshape(-1)[piece.start: piece.start + piece.numel] if piece.numel != full.numel()
                        else full.reshape(-1))
        if not torch.equal(d.full_tensor(), full):
            problems.append(f"{tuple(full.shape)}: loaded value differs")
    dist.barrier()
    return problems


def _replicas(mesh: Any, layout: Any) -> int:
    n = 1
    for i in layout.replica_dims:
        n *= mesh.size(i)
    return n


def strided() -> list[str]:
    """FSDP2 beside tensor parallelism on a (dp, tp) mesh of four ranks: the even ``_StridedShard``
    parameters are gathered with the others, one all-gather per set of split mesh dimensions; an uneven
    one is left to DTensor's own gather. Every value equals ``full_tensor()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 7, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    params = list(model.parameters())
    problems: list[str] = []
    strided = [p for p in params if any(type(x).__name__ == "_StridedShard" for x in p.placements)]
    if len(strided) != 3:
        problems.append(f"{len(strided)} strided parameters, expected 3 (the column-wise layers')")
    served, gathers = _served(params, {})
    uneven = model[2].weight
    if id(uneven) in served or len(served) != len(params) - 1:
        problems.append(f"{len(served)} of {len(params)} served; the uneven strided one must not be")
    # Split over dp and tp (column-wise weights and biases, strided; the row-wise weight): one all-gather
    # over the four ranks; split over dp alone (the row-wise bias, tp copies): one over dp.
    if gathers != 2:
        problems.append(f"{gathers} all-gathers, expected 2")
    for p in params:
        want = p.full_tensor()
        got = served.get(id(p), _dtensor.full_value(p))
        if not torch.equal(got, want):
            problems.append(f"{tuple(p.shape)} {p.placements}: gathered value differs")
    dist.barrier()
    return problems
