"""Tiny models and the wrapping recipes used by ``wrapkit doctor`` and the tests.

A stack is written outermost first, ``>``-separated: ``"ddp>compile>peft"`` means
``DDP(torch.compile(get_peft_model(llama)))``. Backend names: ``plain``, ``dp``,
``ddp``, ``fsdp`` (FSDP1, per-block, ``use_orig_params=True``), ``fsdp2``
(``fully_shard`` per block and root), ``zero0`` .. ``zero3`` (a DeepSpeed engine).
Layers: ``compile`` (``torch.compile`` with the eager backend: detection and the
forward path are tested, not inductor) and ``peft`` (LoRA on q/v projections).
"""

from __future__ import annotations

from typing import Any

import torch

from ..wrapping import block_classes, fully_shard_per_block

__all__ = ["tiny_llama", "toy_model", "build", "parse_stack", "ds_config", "BACKENDS", "block_classes"]

BACKENDS = ("plain", "dp", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3")


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 32, vocab: int = 128) -> torch.nn.Module:
    """A transformers Llama built from a config (nothing downloaded), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class ToyModel(torch.nn.Module):
    """A config-less model, for when transformers is not installed."""

    _no_split_modules = ["_Block"]

    def __init__(self, dim: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


def toy_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ToyModel()


def parse_stack(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(">") if part.strip()]


def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        # torch's AdamW: DeepSpeed's fused CPU Adam would need a C++ build.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    cfg.update(extra)
    return cfg


def _apply(layer: str, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if layer == "plain":
        return model.to(device)
    if layer == "compile":
        compiled: torch.nn.Module = torch.compile(model, backend="eager")  # type: ignore[assignment]
        return compiled
    if layer == "peft":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # type: ignore[no-any-return]
    if layer == "dp":
        return torch.nn.DataParallel(model.to(device))
    if layer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(device)
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if layer == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        blocks = block_classes(model)
        return FullyShardedDataParallel(
            model,
            device_id=device,
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy(blocks) if blocks else None,
        )
    if layer == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        return fully_shard_per_block(model.to(device), mesh)
    if layer.startswith("zero") and layer[4:].isdigit():
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=ds_config(int(layer[4:])))
        return engine  # type: ignore[no-any-return]
    raise ValueError(f"unknown stack layer {layer!r}; known: {', '.join(BACKENDS)}, compile, peft")


def build(spec: str, *, model: torch.nn.Module | None = None, device: torch.device | str | None = None,
          seed: int = 0) -> torch.nn.Module:
    """Wrap ``model`` (default: ``tiny_llama(seed)``) as ``spec`` says, innermost layer first."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    model = tiny_llama(seed) if model is None else model
    for layer in reversed(parse_stack(spec)):
        model = _apply(layer, model, dev)
    return model
