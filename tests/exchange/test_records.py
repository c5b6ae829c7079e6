"""DCP's tensor records read straight into their destinations (``wrapkit/formats/records.py``), against
``torch.load`` of the same records: a plain tensor is read exactly, whole or in part, and every record that is
not one (views into larger storages, transposed strides, an offset into the storage, other objects, a damaged
archive) is declined with nothing written, for DCP's own reader to take. A checkpoint ``torch.distributed.checkpoint``
wrote itself reads the same through wrapkit's reader as through DCP's."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from wrapkit.formats.records import describe, read_record


def _record(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def _in_file(tmp_path: Path, records: list[bytes]) -> tuple[io.BufferedReader, list[tuple[int, int]]]:
    """The records one after the other in one file, as DCP writes a rank's, with each one's place."""
    path = tmp_path / "records.bin"
    places = []
    with open(path, "wb") as f:
        f.write(b"\0" * 13)  # records do not start at the file's start
        for r in records:
            places.append((f.tell(), len(r)))
            f.write(r)
    return open(path, "rb"), places


@pytest.mark.parametrize("tensor", [
    torch.randn(7, 5), torch.randn(3, 4, 6).to(torch.bfloat16), torch.arange(11), torch.tensor(2.5),
    torch.rand(9) > 0.5, torch.randn(4, 3).to(torch.float16), torch.zeros(0, 4)],
    ids=["fp32", "bf16-3d", "int64", "scalar", "bool", "fp16", "empty"])
def test_a_plain_tensor_reads_as_torch_load_reads_it(tmp_path: Path, tensor: torch.Tensor) -> None:
    f, [(start, length)] = _in_file(tmp_path, [_record(tensor)])
    with f:
        found = describe(f, start, length)
        assert found is not None and found.dtype == tensor.dtype and found.shape == tuple(tensor.shape)
        target = torch.full_like(tensor, 7)
        assert read_record(f, start, length, (0,) * tensor.dim(), tuple(tensor.shape), target)
        assert torch.equal(target, tensor)


def test_a_part_of_the_record_lands_in_a_strided_destination(tmp_path: Path) -> None:
    tensor = torch.randn(6, 8)
    f, [(start, length)] = _in_file(tmp_path, [_record(tensor)])
    with f:
        dest = torch.zeros(8, 10)
        target = dest[1:4, 2:7]  # not contiguous
        assert read_record(f, start, length, (2, 3), (3, 5), target)
    assert torch.equal(target, tensor[2:5, 3:8])
    target.zero_()
    assert not dest.any()  # nothing outside the part written


@pytest.mark.parametrize("make", [
    lambda: torch.randn(8, 6)[2:5],            # a view whose storage is larger
    lambda: torch.randn(5, 7).t(),             # transposed strides, storage the same size
    lambda: torch.randn(20)[4:],               # an offset into its storage
    lambda: {"a": torch.randn(3)},             # not a tensor
    lambda: [torch.randn(3), torch.randn(3)],  # several storages
], ids=["larger-storage", "transposed", "offset", "dict", "list"])
def test_anything_else_is_declined_with_nothing_written(tmp_path: Path, make: object) -> None:
    obj = make()  # type: ignore[operator]
    f, [(start, length)] = _in_file(tmp_path, [_record(obj)])
    with f:
        assert describe(f, start, length) is None
        shape = tuple(obj.shape) if isinstance(obj, torch.Tensor) else (3,)
        target = torch.full(shape, 7.0)
        assert not read_record(f, start, length, (0,) * len(shape), shape, target)
        assert bool((target == 7).all())


def test_a_record_of_another_dtype_or_a_damaged_one_is_declined(tmp_path: Path) -> None:
    good = _record(torch.randn(4, 4))
    damaged = bytearray(good)
    damaged[-22:-18] = b"XXXX"  # the end of the archive's directory
    f, [(start, length), (start2, length2), (start3, length3)] = _in_file(
        tmp_path, [good, bytes(damaged), pickle.dumps(torch.randn(2))])
    with f:
        target = torch.full((4, 4), 7.0, dtype=torch.float64)
        assert not read_record(f, start, length, (0, 0), (4, 4), target) and bool((target == 7).all())
        assert describe(f, start2, length2) is None
        assert describe(f, start3, length3) is None


def test_a_checkpoint_dcp_wrote_reads_the_same_through_wrapkits_reader(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from wrapkit.training.manifest import reader_class

    state = {"w": torch.randn(16, 8), "b": torch.randn(8).to(torch.bfloat16), "steps": torch.tensor(3),
             "t": torch.randn(6, 4).t(), "extra": {"lr": 0.1}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    theirs = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"lr": 0.0}) for k, v in state.items()}
    mine = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"lr": 0.0}) for k, v in state.items()}
    dcp.load(theirs, checkpoint_id=str(tmp_path / "ckpt"))
    metadata = FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    loads: list[object] = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    dcp.load(mine, storage_reader=reader_class()(str(tmp_path / "ckpt"), metadata))
    records = [a for a in loads if not isinstance(a[0], io.BytesIO)]  # objects load from bytes
    assert len(records) == 1  # of the tensor records, the transposed one alone went through torch.load
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(mine[k], v) and torch.equal(theirs[k], v), k
        else:
            assert mine[k] == theirs[k] == v
    assert os.path.isdir(tmp_path / "ckpt")
