"""Tiny models, and the stacks ``wrapkit doctor``, the benchmarks and the tests build from them.

Each backend's way of wrapping is its adapter's ``recipe`` (``adapters/core/recipes.py``), read here from the
registry: a backend registered with a recipe is built like the built-in ones.

A stack is written outermost first, ``>``-separated: ``"ddp>compile>peft"`` means
``DDP(torch.compile(get_peft_model(llama)))``. Backend names: ``plain``, ``dp``,
``ddp``, ``fsdp`` (FSDP1, per-block, ``use_orig_params=True``), ``fsdp2``
(``fully_shard`` per block and root), ``zero0`` .. ``zero3`` (a DeepSpeed engine).
Layers: ``compile`` (``torch.compile`` with the eager backend: detection and the
forward path are tested, not inductor) and ``peft`` (LoRA on q/v projections).

``precision`` is each backend's usual mixed precision: fp32 weights computed in
bf16/fp16 (FSDP1 ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``, both reducing in
fp32), DeepSpeed's ``bf16``/``fp16`` section (half weights, fp32 masters in the
optimizer), and half weights for the unsharded ones. ``topology`` says how the ranks
are arranged (see ``TOPOLOGIES``).
"""

from __future__ import annotations

import torch

from .._registry import registered_adapters
from ..adapters import CONTENT_ADAPTERS
from ..adapters.core.likeness import block_classes
from ..adapters.core.recipes import TOPOLOGIES, Recipe, Setting, ds_config, tensor_parallel

__all__ = ["tiny_llama", "toy_model", "fill_adapters", "build", "parse_stack", "ds_config", "BACKENDS", "block_classes",
           "PRECISIONS", "TOPOLOGIES", "INDEPENDENT", "supports", "recipes", "backend_of", "needs", "tensor_parallel"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The layouts that train one model on each half of the ranks (no replicas between them).
INDEPENDENT = frozenset({"submesh", "subgroup"})


def recipes() -> dict[str, tuple[str, Recipe]]:
    """Stack layer name -> (the backend it builds, its recipe), for every registered adapter that has one,
    fewest shards first."""
    found = [(layer, a.name, a.recipe) for a in (*registered_adapters(), *CONTENT_ADAPTERS) if a.recipe is not None
             for layer in a.recipe.layers]
    return {layer: (name, recipe) for layer, name, recipe in sorted(found, key=lambda f: (f[2].order, f[0]))}


BACKENDS = tuple(recipes())


def backend_of(layer: str) -> str | None:
    """The backend a stack layer builds (``"zero3"`` -> ``"deepspeed"``), or None for another layer."""
    found = recipes().get(layer)
    return None if found is None else found[0]


def needs(layer: str) -> str | None:
    """The optional library a stack layer's backend takes, or None."""
    found = recipes().get(layer)
    return None if found is None else found[1].needs


def supports(backend: str, topology: str) -> str | None:
    """None when ``backend`` (a stack layer) runs over ``topology``, else why not."""
    if topology not in TOPOLOGIES:
        return f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}"
    if topology == "flat":
        return None
    known = recipes()
    allowed = sorted(layer for layer, (_, recipe) in known.items() if topology in recipe.topologies)
    if backend not in allowed:
        return f"{topology} is a layout of {' and '.join(allowed)}, not of {backend}"
    return None


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


def fill_adapters(model: torch.nn.Module, seed: int, zeroed: bool = False) -> torch.nn.Module:
    """Every LoRA matrix of ``model`` random from ``seed`` (distinct in each row, so that no rank's slice
    passes for another's), or zero; returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.zeros(p.shape) if zeroed else torch.randn(p.shape, generator=gen))
    return model


def toy_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ToyModel()


def parse_stack(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(">") if part.strip()]


def _apply(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    if layer == "compile":
        compiled: torch.nn.Module = torch.compile(model, backend="eager")  # type: ignore[assignment]
        return compiled
    if layer == "peft":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # type: ignore[no-any-return]
    found = recipes().get(layer)
    if found is None:
        raise ValueError(f"unknown stack layer {layer!r}; known: {', '.join(recipes())}, compile, peft")
    return found[1].build(layer, model, setting)


def build(spec: str, *, model: torch.nn.Module | None = None, device: torch.device | str | None = None,
          seed: int = 0, precision: str = "fp32", topology: str = "flat") -> torch.nn.Module:
    """Wrap ``model`` (default: ``tiny_llama(seed)``) as ``spec`` says, innermost layer first."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    why = supports(parse_stack(spec)[0], topology)
    if why is not None:
        raise ValueError(why)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    half = PRECISIONS[precision] if precision != "fp32" else None
    setting = Setting(dev, half, precision, topology)
    model = tiny_llama(seed) if model is None else model
    for layer in reversed(parse_stack(spec)):
        model = _apply(layer, model, setting)
    return model
