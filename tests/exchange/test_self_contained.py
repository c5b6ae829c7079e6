"""A checkpoint directory is self-contained: index entries, files and adapter directories that lead
outside it (``..``, absolute paths, symbolic links) are refused before anything is read or written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import wrapkit
from wrapkit import StateDictError
from wrapkit.cli._models import tiny_llama

INDEX = "model.safetensors.index.json"


def _saved(tmp_path: Path) -> Path:
    """A sharded save_pretrained directory of a seeded Llama, beside an ``outside`` directory."""
    directory = tmp_path / "ckpt"
    wrapkit.adapt(tiny_llama(1)).save_pretrained(directory, max_shard_size="16KB")
    (tmp_path / "outside").mkdir()
    return directory


def _move_out(directory: Path, how: str) -> str:
    """Take the first shard out of ``directory`` and make the index reach it ``how``; the entry's name."""
    index = json.loads((directory / INDEX).read_text())
    name, file = next(iter(sorted(index["weight_map"].items())))
    outside = directory.parent / "outside" / file
    shutil.move(directory / file, outside)
    if how == "symlink":  # the index is unchanged; the file in the directory is a link leading out
        os.symlink(outside, directory / file)
    else:
        target = f"../outside/{file}" if how == "dotdot" else str(outside)
        index["weight_map"] = {k: (target if v == file else v) for k, v in index["weight_map"].items()}
        (directory / INDEX).write_text(json.dumps(index))
    return name


def _refused(directory: Path, **kwargs: Any) -> str:
    model = tiny_llama(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictError) as caught:
        wrapkit.adapt(model).load(directory, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a refused load wrote something"
    return str(caught.value)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_an_index_entry_leading_out_of_the_directory_is_refused(tmp_path: Path, how: str) -> None:
    directory = _saved(tmp_path)
    entry = _move_out(directory, how)
    text = _refused(directory)
    assert "nothing was written" in text and repr(entry) in text and "outside the directory" in text, text
    assert str(tmp_path / "outside") in text, text  # where it leads


def test_a_linked_single_file_leading_out_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (tmp_path / "outside").mkdir()
    wrapkit.adapt(tiny_llama(1)).save(tmp_path / "outside" / "model.safetensors")
    os.symlink(tmp_path / "outside" / "model.safetensors", directory / "model.safetensors")
    text = _refused(directory)
    assert "outside the directory" in text and "model.safetensors" in text, text


def test_links_inside_the_directory_are_followed(tmp_path: Path) -> None:
    """A shard linked to another name inside the directory (deduplicated storage) stays readable."""
    directory = _saved(tmp_path)
    index = json.loads((directory / INDEX).read_text())
    file = sorted(set(index["weight_map"].values()))[0]
    (directory / "store").mkdir()
    shutil.move(directory / file, directory / "store" / file)
    os.symlink(directory / "store" / file, directory / file)
    model = wrapkit.adapt(tiny_llama(2))
    model.load(directory)
    want = tiny_llama(1).state_dict()
    assert all(torch.equal(want[k], v) for k, v in model.unwrap().state_dict().items())


@pytest.mark.parametrize("how", ["file", "subdirectory"])
def test_adapter_files_leading_out_are_refused(tmp_path: Path, how: str) -> None:
    from tests.exchange.scenarios_peft import lora_model

    directory = tmp_path / "adapters"
    wrapkit.adapt(lora_model(1)).save_pretrained(directory, adapters_only=True)
    (tmp_path / "outside").mkdir()
    if how == "file":
        shutil.move(directory / "adapter_model.safetensors", tmp_path / "outside" / "adapter_model.safetensors")
        os.symlink(tmp_path / "outside" / "adapter_model.safetensors", directory / "adapter_model.safetensors")
    else:  # the second adapter's subdirectory is a link to one elsewhere
        shutil.move(directory / "second", tmp_path / "outside" / "second")
        os.symlink(tmp_path / "outside" / "second", directory / "second")
    model = wrapkit.adapt(lora_model(0, zeroed=True))
    before = {k: v.clone() for k, v in model.unwrap().state_dict().items()}
    with pytest.raises(StateDictError) as caught:
        model.load(directory)
    text = str(caught.value)
    assert "outside the adapter directory" in text and str(tmp_path / "outside") in text, text
    assert all(torch.equal(before[k], v) for k, v in model.unwrap().state_dict().items())


def test_every_rank_refuses_an_escaping_index(group: Any) -> None:
    from tests.exchange import scenarios_state

    for obs in group.run(scenarios_state.escaping_index, timeout=120):
        for error in obs["errors"]:  # every rank reading, and rank 0 reading for all
            assert error.startswith("StateDictError") and "outside the directory" in error, obs
        assert obs["unchanged"], "a refused load wrote something"
