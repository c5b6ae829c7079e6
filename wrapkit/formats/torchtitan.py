"""torchtitan's models in the Hub's layout, by torchtitan's own knowledge of it.

Each torchtitan model family has a ``StateDictAdapter`` (``torchtitan.models.<family>.state_dict_adapter``) whose
``to_hf`` / ``from_hf`` convert the model's state dict to the Hub checkpoint of the matching transformers model and
back. It is built from the model's config, which torchtitan's decoders keep as ``model.config``. ``titan_layout``
finds the adapter of a model's family and wraps it in a ``MappedLayout``; the transformers config that goes
beside the tensors (``config.json``) is made from the same config for the families whose Hub model is known here
(Llama 3 as ``LlamaConfig``, Qwen3 as ``Qwen3Config`` or ``Qwen3MoeConfig``).
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from typing import Any

import torch

from .mapped import MappedLayout

__all__ = ["titan_layout", "titan_hub_config"]


def _family(model: torch.nn.Module) -> str | None:
    """The package of the torchtitan family ``model`` belongs to (``torchtitan.models.llama3``)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("torchtitan.models."):
            return cls.__module__.rsplit(".", 1)[0]
    return None


def _adapter_class(package: str) -> type | None:
    """The state-dict adapter the family's package defines (not one it imports), or None."""
    try:
        module = importlib.import_module(package + ".state_dict_adapter")
    except ImportError:
        return None
    found = [c for _, c in inspect.getmembers(module, inspect.isclass)
             if c.__module__ == module.__name__ and callable(getattr(c, "to_hf", None))
             and callable(getattr(c, "from_hf", None))]
    return found[0] if len(found) == 1 else None


# Each model's layout, made once (an operation looks it up every call). Weak on the model; a layout holds the
# adapter and the model's config, not the model.
_MADE: weakref.WeakKeyDictionary[torch.nn.Module, MappedLayout | None] = weakref.WeakKeyDictionary()


def titan_layout(model: torch.nn.Module) -> MappedLayout | None:
    """torchtitan's Hub mapping of ``model`` (its family's ``StateDictAdapter`` over its config), or None where
    ``model`` is not a torchtitan model with one."""
    if model not in _MADE:
        _MADE[model] = _made(model)
    return _MADE[model]


def _made(model: torch.nn.Module) -> MappedLayout | None:
    family = _family(model)
    config = getattr(model, "config", None)
    if family is None or config is None:
        return None
    cls = _adapter_class(family)
    if cls is None:
        return None
    adapter = cls(config, None)
    return MappedLayout(adapter.to_hf, adapter.from_hf, titan_hub_config(family, config))


def _rope(rope: Any) -> dict[str, Any] | None:
    """transformers' ``rope_parameters`` for torchtitan's rope config, or None for a scaling not named here."""
    scaling = getattr(rope, "scaling", "none")
    params: dict[str, Any] = {"rope_theta": float(rope.theta)}
    if scaling == "none":
        return {"rope_type": "default", **params}
    if scaling == "llama":
        return {"rope_type": "llama3", **params, "factor": float(rope.scaling_factor),
                "low_freq_factor": float(rope.low_freq_factor), "high_freq_factor": float(rope.high_freq_factor),
                "original_max_position_embeddings": int(rope.original_max_position_embeddings)}
    return None


def titan_hub_config(package: str, config: Any) -> Any:
    """The transformers config of the Hub model that a torchtitan config of ``package``'s family is, or None where
    none is known here (another family, a rope scaling or a layer mix transformers' model does not have)."""
    try:
        import transformers
    except ImportError:
        return None
    family = package.rsplit(".", 1)[-1]
    layers = list(config.layers)
    attn = layers[0].attention
    rope = _rope(attn.rope)
    if family not in ("llama3", "qwen3") or rope is None:
        return None
    heads = int(attn.n_heads)
    common: dict[str, Any] = dict(
        vocab_size=int(config.vocab_size), hidden_size=int(config.dim), num_hidden_layers=len(layers),
        num_attention_heads=heads, num_key_value_heads=int(attn.n_kv_heads or heads),
        head_dim=int(attn.head_dim or config.dim // heads), max_position_embeddings=int(attn.rope.max_seq_len),
        rms_norm_eps=float(config.norm.eps), tie_word_embeddings=bool(getattr(config, "enable_weight_tying", False)),
        rope_parameters=rope, hidden_act="silu", attention_bias=False)
    moes = [layer.moe for layer in layers if getattr(layer, "moe", None) is not None]
    ffn = next((layer.feed_forward for layer in layers if getattr(layer, "feed_forward", None) is not None), None)
    if family == "llama3":
        if moes or ffn is None:
            return None
        return transformers.LlamaConfig(**common, intermediate_size=int(ffn.w1.out_features), mlp_bias=False)
    if not moes:
        return transformers.Qwen3Config(**common, intermediate_size=int(ffn.w1.out_features) if ffn else 0)
    moe = moes[0]
    if len(moes) != len(layers) or any(getattr(m, "shared_experts", None) is not None for m in moes) or \
            moe.router.score_func != "softmax" or float(moe.router.route_scale) != 1.0:
        return None  # dense layers among the mixtures, shared experts or other routing: not Qwen3-MoE's
    experts = moe.routed_experts.inner_experts
    return transformers.Qwen3MoeConfig(
        **common, num_experts=int(experts.num_experts), num_experts_per_tok=int(moe.router.top_k),
        moe_intermediate_size=int(experts.hidden_dim), norm_topk_prob=bool(moe.router.route_norm),
        decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=int(experts.hidden_dim))
