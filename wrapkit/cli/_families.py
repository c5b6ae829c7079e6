"""Tiny models of the families people train, built from configs (nothing downloaded), for the doctor's
``--model`` and the family matrix of the tests.

Each family stands for a layout transformers treats apart: tied embeddings (Qwen2, Gemma 3, T5), experts
fused at run time and stored per expert on the Hub (Qwen3-MoE, DeepSeek-V3) or fused in both (gpt-oss),
vision-language prefixes that differ between run time and the Hub (Qwen2-VL, Llava), an encoder-decoder
(T5), a sequence-classification head (a reward model), and a model whose ``state_dict()`` differs from its
parameters by hooks of its own (a Llama with fused SwiGLU projections, as torchtitan's and fused-kernel models
hold them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FAMILIES", "TP_RECIPE", "PIPELINE_RECIPE", "MEGATRON_RECIPE", "RECIPE_FAMILIES", "family_model",
           "family_inputs", "any_model", "model_inputs"]

_TEXT: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _llama(tf: Any) -> Any:
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_TEXT, tie_word_embeddings=False))


def _qwen2_tied(tf: Any) -> Any:
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_TEXT, tie_word_embeddings=True))


def _gemma3(tf: Any) -> Any:
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_TEXT, head_dim=8))


def _qwen3_moe(tf: Any) -> Any:
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**_TEXT, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=16, decoder_sparse_step=1))


def _gpt_oss(tf: Any) -> Any:
    return tf.GptOssForCausalLM(tf.GptOssConfig(**{**_TEXT, "intermediate_size": 32}, head_dim=8,
                                                num_local_experts=4, num_experts_per_tok=2))


def _deepseek_v3(tf: Any) -> Any:
    # Multi-head latent attention has as many key/value heads as query heads.
    return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**_TEXT, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8))


def _qwen2_vl(tf: Any) -> Any:
    return tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
        text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=1,
                         eos_token_id=2),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1, in_channels=3),
        image_token_id=120, video_token_id=121, vision_start_token_id=122))


def _llava(tf: Any) -> Any:
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 image_size=16, patch_size=8, projection_dim=32)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=tf.LlamaConfig(**_TEXT),
                                                           image_token_index=120))


def _t5(tf: Any) -> Any:
    # No dropout: the doctor compares a training-mode forward with the unwrapped model's.
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                     num_heads=4, decoder_start_token_id=0, dropout_rate=0.0))


class FusedSwiGLU(torch.nn.Module):
    """A Llama MLP whose gate and up projections are one matrix (``gate_up_proj``: the gate rows, then the up
    rows), as fused SwiGLU kernels hold them; its state-dict hooks split it into transformers' ``gate_proj`` and
    ``up_proj`` on save and join them on load, so its checkpoints are a Llama's."""

    def __init__(self, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(gate.in_features, 2 * gate.out_features, bias=False)
        self.down_proj = down
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
        self.register_state_dict_post_hook(_split_gate_up)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_join_gate_up)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)  # type: ignore[no-any-return]


def _split_gate_up(module: torch.nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    fused = state.pop(f"{prefix}gate_up_proj.weight", None)
    if fused is not None:
        gate, up = fused.chunk(2, dim=0)
        state[f"{prefix}gate_proj.weight"], state[f"{prefix}up_proj.weight"] = gate.clone(), up.clone()


def _join_gate_up(module: torch.nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
    keys = (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight")
    if all(k in state for k in keys):
        state[f"{prefix}gate_up_proj.weight"] = torch.cat([state.pop(k) for k in keys])


def _llama_fused(tf: Any) -> Any:
    model = _llama(tf)
    for layer in model.model.layers:
        mlp = layer.mlp
        layer.mlp = FusedSwiGLU(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return model


def _llama_reward(tf: Any) -> Any:
    return tf.LlamaForSequenceClassification(tf.LlamaConfig(**_TEXT, num_labels=1, pad_token_id=0))


FAMILIES: dict[str, Callable[[Any], Any]] = {
    "llama": _llama, "qwen2-tied": _qwen2_tied, "gemma3": _gemma3, "qwen3-moe": _qwen3_moe, "gpt-oss": _gpt_oss,
    "deepseek-v3": _deepseek_v3, "qwen2-vl": _qwen2_vl, "llava": _llava, "t5": _t5, "llama-reward": _llama_reward,
    "llama-fused": _llama_fused,
}

# The families the doctor's tensor-parallel recipe (``_models.tensor_parallel``: attention heads and MLP
# projections split column- then row-wise) computes the unsplit model's outputs for. It does not fit
# DeepSeek-V3's latent attention, gpt-oss's per-head sinks or T5's tied head outside ``model.layers``;
# transformers' own ``tp_plan`` parallelizes those.
TP_RECIPE = frozenset({"llama", "qwen2-tied", "gemma3", "qwen3-moe", "qwen2-vl", "llava", "llama-reward"})
# The families transformers 5.24 splits into pipeline stages: decoder-only language models. Its split looks for
# `model.layers` (vision-language models and T5 have none there) and its staged forward serves the language-model
# head only (a reward model's scores never reach the last stage's caller).
PIPELINE_RECIPE = frozenset({"llama", "qwen2-tied", "gemma3", "qwen3-moe", "gpt-oss", "deepseek-v3"})
# The families the Megatron-Core recipe builds the GPTModel of (``formats.megatron.megatron_settings``): RMSNorm,
# rotary positions, SwiGLU, no linear biases but q/k/v's, and Qwen3-MoE's mixture (its experts over two
# expert-parallel ranks). Gemma's norms and GELU, other mixtures, latent attention and the other heads have no
# Megatron model named here.
MEGATRON_RECIPE = frozenset({"llama", "qwen2-tied", "qwen3-moe"})
# A backend whose recipe serves only some families: those, and why the others are shown as unsupported.
RECIPE_FAMILIES: dict[str, tuple[frozenset[str], str]] = {
    "tp": (TP_RECIPE | {"toy"}, "the doctor's tensor-parallel recipe does not fit {model}; transformers' tp_plan "
                                "does"),
    "pipeline": (PIPELINE_RECIPE, "transformers' pipeline split (DistributedConfig(pp_size=...)) does not serve "
                                  "{model}"),
    "megatron": (MEGATRON_RECIPE, "the Megatron-Core recipe builds Llama-, Qwen2- and Qwen3-MoE-style models "
                                  "(RMSNorm, rotary positions, SwiGLU), not {model}"),
}


def family_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model of ``family`` (a key of ``FAMILIES``), seeded, in training mode."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    model: torch.nn.Module = FAMILIES[family](transformers)
    model.train()
    return model


def family_inputs(model: torch.nn.Module, batch: int = 2, length: int = 8) -> dict[str, torch.Tensor]:
    """Keyword inputs for a text-only forward of ``model`` (decoder inputs too for an encoder-decoder)."""
    ids = (torch.arange(batch * length).reshape(batch, length) * 7 + 3) % 100
    inputs = {"input_ids": ids}
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids.flip(-1)
    return inputs


# The doctor's model by name: "toy" (an MLP, without transformers), "llama", or another of FAMILIES.
def any_model(model: str, seed: int = 0) -> torch.nn.Module:
    """The model the doctor wraps, seeded."""
    from ._models import tiny_llama, toy_model

    if model == "toy":
        return toy_model(seed)
    return tiny_llama(seed) if model == "llama" else family_model(model, seed)


def model_inputs(model: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The positional input and the keyword ones (an encoder-decoder's decoder inputs)."""
    if model == "toy":
        return torch.linspace(-1, 1, 32).reshape(2, 16), {}
    ids = torch.arange(16).reshape(2, 8) % 128
    if model == "llama":
        return ids, {}
    extra = family_inputs(any_model(model))
    return extra.pop("input_ids"), extra
