"""A Megatron-Core GPT model's weights in the Hub's layout of the transformers model of the same architecture
(Llama, Qwen2, Qwen3), both ways, and that model's config.

Megatron fuses what transformers keeps apart: ``linear_qkv`` holds, for each query group in turn, the group's
query heads, then its key head, then its value head; ``linear_fc1`` of a gated MLP holds the gate rows, then the
up rows. Its names differ too (``decoder.layers.N.self_attention.linear_proj`` for ``model.layers.N.self_attn
.o_proj``), and a tied head is kept once, by the embedding. The runtime names here are the whole model's:
layers under their global numbers, as the megatron adapter names them.

Which Hub model a Megatron config is: RMSNorm, rotary positions, a gated SiLU MLP and no linear biases, with
biases on q, k and v (Qwen2), per-head q/k norms (Qwen3), or neither (Llama). Anything else (LayerNorm, learned
positions, GELU, mixtures of experts, multi-latent attention) has no Hub model named here, and
``MegatronLayout.of`` says which setting keeps it out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .mapped import row_segments

__all__ = ["MegatronLayout", "hub_refusal", "megatron_settings"]

Reader = Callable[[str], torch.Tensor]

# Megatron's name within a layer -> the Hub's, for tensors taken over as they are. Transformer Engine's
# specs fold the norm into the next linear layer (``layer_norm_weight``): both spellings are known.
_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc[12]\.weight$")
_HUB_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.")
_HUB_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _mlp_of(rest: str) -> str | None:
    """The Hub's prefix of the MLP (or of the expert) a layer's ``linear_fc1``/``linear_fc2`` weight is in, or
    None for another tensor."""
    if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
        return "mlp."
    found = _EXPERT.match(rest)
    return None if found is None else f"mlp.experts.{found.group(1)}."


def hub_refusal(model: Any) -> str | None:
    """Why ``model`` (a Megatron-Core GPT model) has no Hub layout here, or None."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "vocab_size"):
        return f"{type(model).__name__} is not a Megatron-Core GPT model"
    act = getattr(getattr(cfg, "activation_func", None), "__name__", "")
    checks = [
        (getattr(cfg, "normalization", "") == "RMSNorm", f"normalization={getattr(cfg, 'normalization', None)!r}"),
        (getattr(model, "position_embedding_type", "") == "rope",
         f"position_embedding_type={getattr(model, 'position_embedding_type', None)!r}"),
        (bool(getattr(cfg, "gated_linear_unit", False)) and act == "silu", "an MLP other than gated SiLU (SwiGLU)"),
        (not getattr(cfg, "add_bias_linear", True), "add_bias_linear=True"),
        *_mixture_checks(cfg),
        (not getattr(cfg, "multi_latent_attention", False), "multi_latent_attention=True"),
        (getattr(model, "rotary_percent", 1.0) == 1.0, f"rotary_percent={getattr(model, 'rotary_percent', None)}"),
    ]
    bad = [what for ok, what in checks if not ok]
    if not bad:
        return None
    return (f"the Megatron-Core model has {', '.join(bad)}: its Hub layout is known for Llama-, Qwen2-, Qwen3- and "
            "Qwen3-MoE-style configs (RMSNorm, rotary positions, SwiGLU, no linear biases)")


def _mixture_checks(cfg: Any) -> list[tuple[bool, str]]:
    """What a mixture of experts needs for Qwen3-MoE's layout: q/k norms, every layer's MLP a mixture of experts
    each in a module of its own, routed by a softmax over the top k, with no shared experts or other routing."""
    if not getattr(cfg, "num_moe_experts", None):
        return []
    return [
        (bool(getattr(cfg, "qk_layernorm", False)), "a mixture of experts without q/k norms (Qwen3-MoE has them)"),
        (getattr(cfg, "moe_layer_freq", 1) == 1, f"moe_layer_freq={getattr(cfg, 'moe_layer_freq', None)!r}"),
        (not getattr(cfg, "moe_grouped_gemm", False), "moe_grouped_gemm=True (its experts in one tensor)"),
        (not getattr(cfg, "moe_shared_expert_intermediate_size", None), "shared experts"),
        (getattr(cfg, "moe_router_score_function", "softmax") == "softmax",
         f"moe_router_score_function={getattr(cfg, 'moe_router_score_function', None)!r}"),
        (not getattr(cfg, "moe_router_enable_expert_bias", False), "moe_router_enable_expert_bias=True"),
        (not getattr(cfg, "moe_router_num_groups", None), "grouped routing (moe_router_num_groups)"),
        (getattr(cfg, "moe_router_topk_scaling_factor", None) in (None, 1.0), "moe_router_topk_scaling_factor"),
    ]


def megatron_settings(hub: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse of ``MegatronLayout.hub_config``: ``TransformerConfig``'s and ``GPTModel``'s keyword arguments
    for a transformers Llama, Qwen2 or Qwen3 config (the parallel sizes and dtypes left to the caller). A config
    with no Megatron model named here raises ``ValueError`` naming what keeps it out."""
    kind = getattr(hub, "model_type", None)
    rope = dict(getattr(hub, "rope_parameters", None) or {})
    bias = bool(getattr(hub, "attention_bias", False)) or kind == "qwen2"
    bad = [what for ok, what in [
        (kind in ("llama", "qwen2", "qwen3", "qwen3_moe"),
         f"model_type={kind!r} (Llama, Qwen2, Qwen3 and Qwen3-MoE are known)"),
        (not getattr(hub, "mlp_only_layers", None) and getattr(hub, "decoder_sparse_step", 1) == 1,
         "dense layers among the mixtures (mlp_only_layers, decoder_sparse_step)"),
        (getattr(hub, "hidden_act", None) == "silu", f"hidden_act={getattr(hub, 'hidden_act', None)!r}"),
        (not getattr(hub, "mlp_bias", False), "mlp_bias=True"),
        (rope.get("rope_type", "default") == "default", f"rope_type={rope.get('rope_type')!r}"),
        (not (kind == "llama" and bias), "attention_bias=True on a Llama"),
    ] if not ok]
    if bad:
        raise ValueError(f"no Megatron-Core GPT model matches this transformers config: {', '.join(bad)}")
    heads = int(hub.num_attention_heads)
    config = dict(
        num_layers=int(hub.num_hidden_layers), hidden_size=int(hub.hidden_size), num_attention_heads=heads,
        num_query_groups=int(getattr(hub, "num_key_value_heads", None) or heads),
        kv_channels=int(getattr(hub, "head_dim", None) or hub.hidden_size // heads),
        ffn_hidden_size=int(hub.intermediate_size), normalization="RMSNorm", layernorm_epsilon=float(hub.rms_norm_eps),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=bias,
        qk_layernorm=kind in ("qwen3", "qwen3_moe"), hidden_dropout=0.0,
        attention_dropout=float(getattr(hub, "attention_dropout", 0.0)), persist_layer_norm=False)
    if kind == "qwen3_moe":
        # Qwen3-MoE's renormalised top k is Megatron's softmax over the top k logits; without it, the top k of
        # the softmax over all.
        config.update(num_moe_experts=int(hub.num_experts), moe_router_topk=int(hub.num_experts_per_tok),
                      moe_ffn_hidden_size=int(hub.moe_intermediate_size),
                      moe_router_pre_softmax=not hub.norm_topk_prob, moe_token_dispatcher_type="allgather")
    model = dict(vocab_size=int(hub.vocab_size), max_sequence_length=int(hub.max_position_embeddings),
                 position_embedding_type="rope", share_embeddings_and_output_weights=bool(hub.tie_word_embeddings),
                 rotary_base=float(rope.get("rope_theta", 10000.0)))
    return config, model


class MegatronLayout:
    """The conversions between a Megatron-Core GPT model's runtime names and tensors (whole model, global layer
    numbers) and the Hub's of the matching transformers model."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.heads = int(cfg.num_attention_heads)
        self.groups = int(cfg.num_query_groups or cfg.num_attention_heads)
        self.head_dim = int(cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads)
        self.tied = bool(model.share_embeddings_and_output_weights)

    @staticmethod
    def of(model: Any) -> MegatronLayout:
        """The layout of ``model``; ``UnsupportedModelError`` naming the setting where it has none here."""
        from .._errors import UnsupportedModelError

        why = hub_refusal(model)
        if why is not None:
            raise UnsupportedModelError(f"{why}; export it in Megatron's own names instead (full_state_dict(), "
                                        "named_full_parameters(), or save() and stream_full_parameters(layout="
                                        "'runtime')).")
        return MegatronLayout(model)

    # -- the config -------------------------------------------------------------------------
    def hub_config(self) -> Any:
        """The transformers config of the matching model (Qwen3 with q/k norms, Qwen2 with q/k/v biases, else
        Llama)."""
        import transformers

        model, cfg = self.model, self.model.config
        common: dict[str, Any] = dict(
            vocab_size=int(model.vocab_size), hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.ffn_hidden_size), num_hidden_layers=int(cfg.num_layers),
            num_attention_heads=self.heads, num_key_value_heads=self.groups, head_dim=self.head_dim,
            max_position_embeddings=int(model.max_sequence_length), rms_norm_eps=float(cfg.layernorm_epsilon),
            tie_word_embeddings=self.tied, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": float(model.rotary_base)},
        )
        if getattr(cfg, "num_moe_experts", None):
            # Megatron's top k of the logits, then a softmax over them, is Qwen3-MoE's renormalised top k.
            return transformers.Qwen3MoeConfig(
                **common, attention_bias=bool(cfg.add_qkv_bias), num_experts=int(cfg.num_moe_experts),
                num_experts_per_tok=int(cfg.moe_router_topk), moe_intermediate_size=int(cfg.moe_ffn_hidden_size),
                norm_topk_prob=not getattr(cfg, "moe_router_pre_softmax", False), decoder_sparse_step=1,
                mlp_only_layers=[])
        if getattr(cfg, "qk_layernorm", False):
            return transformers.Qwen3Config(**common, attention_bias=bool(cfg.add_qkv_bias))
        if getattr(cfg, "add_qkv_bias", False):
            return transformers.Qwen2Config(**common)
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)

    # -- runtime -> checkpoint --------------------------------------------------------------
    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The Hub's ``(name, tensor)`` for a stream of Megatron's (whole tensors, global layer numbers)."""
        for name, tensor in entries:
            if name == "output_layer.weight" and self.tied:
                continue  # transformers ties lm_head to the embedding, which holds it
            if name in _TOP:
                yield _TOP[name], tensor
                continue
            found = _LAYER_NAME.match(name)
            if found is None:
                raise ValueError(f"{name!r} has no place in the Hub's layout of this model")
            layer, rest = found.groups()
            at = f"model.layers.{layer}."
            if rest in _LAYER:
                yield at + _LAYER[rest], tensor
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                for proj, part in zip(_QKV, self.split_qkv(tensor), strict=True):
                    yield f"{at}self_attn.{proj}.{kind}", part
            elif (mlp := _mlp_of(rest)) is not None:
                if rest.endswith("linear_fc1.weight"):
                    gate, up = tensor.chunk(2, dim=0)
                    yield at + mlp + "gate_proj.weight", gate
                    yield at + mlp + "up_proj.weight", up
                else:
                    yield at + mlp + "down_proj.weight", tensor
            else:
                raise ValueError(f"{name!r} has no place in the Hub's layout of this model")

    def fused_group(self, key: str) -> str | None:
        """The tensor of transformers' model a Hub tensor ``key`` is fused into with others kept apart here (a
        layer's experts: ``mlp.experts.gate_up_proj`` and ``down_proj`` at run time), or None: a stream keeps a
        group in one bucket for receivers that load bucket by bucket."""
        found = _HUB_EXPERT.match(key)
        return None if found is None else found.group(1)

    def split_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v out of ``linear_qkv``'s rows (per query group: its query heads, its key, its value)."""
        per = self.heads // self.groups
        grouped = fused.reshape(self.groups, (per + 2) * self.head_dim, *fused.shape[1:])
        q, k, v = torch.split(grouped, [per * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return (q.reshape(-1, *fused.shape[1:]), k.reshape(-1, *fused.shape[1:]), v.reshape(-1, *fused.shape[1:]))

    def join_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        per = self.heads // self.groups
        rest = q.shape[1:]
        parts = (q.reshape(self.groups, per * self.head_dim, *rest), k.reshape(self.groups, self.head_dim, *rest),
                 v.reshape(self.groups, self.head_dim, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    # -- checkpoint -> runtime --------------------------------------------------------------
    def sources(self, name: str) -> list[str] | None:
        """The Hub keys the runtime tensor ``name`` is built from (None: it has no place in the layout)."""
        if name in _TOP:
            return [_TOP["embedding.word_embeddings.weight"]] if name == "output_layer.weight" and self.tied \
                else [_TOP[name]]
        found = _LAYER_NAME.match(name)
        if found is None:
            return None
        layer, rest = found.groups()
        at = f"model.layers.{layer}."
        if rest in _LAYER:
            return [at + _LAYER[rest]]
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            return [f"{at}self_attn.{proj}.{kind}" for proj in _QKV]
        mlp = _mlp_of(rest)
        if mlp is not None and rest.endswith("linear_fc1.weight"):
            return [at + mlp + "gate_proj.weight", at + mlp + "up_proj.weight"]
        if mlp is not None:
            return [at + mlp + "down_proj.weight"]
        return None

    def build(self, name: str, read: Reader) -> torch.Tensor:
        """Runtime tensor ``name`` from its Hub sources (``read(key)``: one whole)."""
        keys = self.sources(name)
        assert keys is not None
        values = [read(k) for k in keys]
        if len(values) == 3:
            return self.join_qkv(*values)
        return values[0] if len(values) == 1 else torch.cat(values, dim=0)

    def from_hub(self, state: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The runtime tensors ``names`` (the whole model's) built from a Hub state dict holding them all."""
        return {name: self.build(name, state.__getitem__) for name in names}

    def imports(self, entries: Mapping[str, tuple[tuple[int, ...], str]],
                runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]:
        """As ``HubLayout.imports``: runtime name -> the one checkpoint key holding it as it is (``renamed``) or
        the build that makes it from several (``converted``); checkpoint keys that fit no runtime name stay under
        their own name in ``renamed``, for the caller to report."""
        renamed: dict[str, str] = {}
        converted: dict[str, Any] = {}
        used: set[str] = set()
        for name in runtime:
            keys = self.sources(name)
            if keys is None or not all(k in entries for k in keys):
                continue
            used.update(keys)
            if len(keys) == 1:
                renamed[name] = keys[0]
            else:
                converted[name] = _Built(self, name, keys, [entries[k][0] for k in keys])
        for key in entries:
            if key not in used:
                renamed.setdefault(key, key)
        return renamed, converted

    def optional(self) -> frozenset[str]:
        """Runtime names a checkpoint may lack: a tied head, which the embedding's tensor builds."""
        return frozenset()


class _Built:
    """One runtime tensor made from several Hub tensors (``linear_qkv``, ``linear_fc1``), read whole."""

    def __init__(self, layout: MegatronLayout, name: str, keys: list[str], shapes: list[tuple[int, ...]]) -> None:
        self.layout, self.name, self._keys = layout, name, keys
        self.shape: tuple[int, ...] | None = (sum(s[0] for s in shapes), *shapes[0][1:]) if all(
            s[1:] == shapes[0][1:] for s in shapes) else None

    def keys(self) -> list[str]:
        return list(self._keys)

    def stacks_rows(self) -> bool:
        return False  # the rows come from several sources, interleaved: ``row_segments`` says which

    def rows(self, read: Reader, first: int, last: int) -> torch.Tensor:
        return self.full(read)[first:last]

    def row_segments(self, first: int, last: int) -> list[tuple[str, int, int]]:
        """Rows ``[first, last)`` of the runtime tensor as ``(source key, first row, last row)`` ranges of the
        sources, in order: a load reads only a rank's own rows of each source."""
        return row_segments(self._source_row(row) for row in range(first, last))

    def _source_row(self, row: int) -> tuple[str, int]:
        if len(self._keys) == 2:  # linear_fc1: the gate rows, then the up rows
            half = self.shape[0] // 2 if self.shape is not None else 0
            return (self._keys[0], row) if row < half else (self._keys[1], row - half)
        lay = self.layout
        per, d = lay.heads // lay.groups, lay.head_dim
        group, within = divmod(row, (per + 2) * d)
        if within < per * d:
            return self._keys[0], group * per * d + within
        if within < (per + 1) * d:
            return self._keys[1], group * d + within - per * d
        return self._keys[2], group * d + within - (per + 1) * d

    def full(self, read: Reader) -> torch.Tensor:
        return self.layout.build(self.name, read)
