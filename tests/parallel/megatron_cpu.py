"""Megatron-Core on the CPU, for tests: the stand-ins for its CUDA assumptions, and tiny GPT models built at
any tensor- and pipeline-parallel size with the same weights.

Megatron-Core assumes CUDA in a few places that a CPU gloo run reaches (measured: ``../shared/notes``): its RNG
tracker keeps CUDA generator states, scratch buffers are made on ``torch.cuda.current_device()``. ``on_cpu()``
puts CPU stand-ins in their place, once per process. They live here, never in wrapkit, which must not care
whether CUDA is there.

The weights: ``use_cpu_initialization`` builds each full weight from the global generator and keeps this rank's
slice, so one seed gives the same model at any tensor-parallel size. Pipeline stages build only their own layers
(the generator runs differently), so ``build`` fills a stage from the whole model built at the same tensor-parallel
size, through Megatron's own ``state_dict``/``load_state_dict`` with the layer numbers shifted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_PATCHED = False


def on_cpu() -> None:
    """Install the CPU stand-ins (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.tensor_parallel import random

    class CpuRngTracker(random.CudaRNGStatesTracker):  # type: ignore[misc]
        """Megatron's named generator states, kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    random._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    # A mixture's forward without Transformer Engine names TE's GEMM, which Megatron's import left undefined.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    _PATCHED = True


def seed_trackers(seed: int, tp_rank: int) -> None:
    """The tracker's states as ``model_parallel_cuda_manual_seed`` adds them."""
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


STYLES: dict[str, dict[str, Any]] = {
    # Llama: RMSNorm, SwiGLU, rotary positions, grouped queries, no biases, an untied head.
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  add_bias_linear=False, add_qkv_bias=False, num_query_groups=2, position="rope", tied=False),
    # Qwen2: as Llama, with biases on q, k and v, and a head tied to the embedding.
    "qwen2": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  add_bias_linear=False, add_qkv_bias=True, num_query_groups=2, position="rope", tied=True),
    # GPT-2: LayerNorm, GELU, learned positions, biases everywhere, a tied head: no Hub model is named for it, so
    # only Megatron's own names are exported.
    "gpt": dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                add_bias_linear=True, add_qkv_bias=True, num_query_groups=4, position="learned_absolute", tied=True),
}


def _model(style: str, dtype: torch.dtype, seed: int, tp: int, pp: int, pre: bool, post: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    opts = dict(STYLES[style])
    position, tied = opts.pop("position"), opts.pop("tied")
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, layernorm_epsilon=1e-6, persist_layer_norm=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, **opts)
    torch.manual_seed(seed)
    # A tied head on another stage than the embedding is synchronised at construction on the CUDA device.
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        return GPTModel(config, get_gpt_layer_local_spec(normalization=opts["normalization"]), vocab_size=64,
                        max_sequence_length=32, pre_process=pre, post_process=post, position_embedding_type=position,
                        share_embeddings_and_output_weights=tied, rotary_base=10000)
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]


def build(style: str = "llama", tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
          seed: int = 0) -> torch.nn.Module:
    """This rank's part of a tiny GPT model over ``tp`` x ``pp`` ranks (data parallel over the rest), the same
    weights at every size for one ``seed``. Megatron's parallel state stays initialised for it."""
    from megatron.core import parallel_state as ps

    on_cpu()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_trackers(seed, ps.get_tensor_model_parallel_rank())
    whole = _model(style, dtype, seed, tp, 1, True, True)
    if pp == 1:
        return whole
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    seed_trackers(seed, ps.get_tensor_model_parallel_rank())
    stage = _model(style, dtype, seed, tp, pp, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    layers: Any = stage.decoder.layers  # type: ignore[union-attr]
    offset = layers[0].layer_number - 1
    full = whole.state_dict()
    own = {}
    for key in stage.state_dict():
        parts = key.split(".")
        if key.startswith("decoder.layers."):
            parts[2] = str(int(parts[2]) + offset)
        name = ".".join(parts)
        # A tied head on the last stage is a copy of the embedding, which the whole model keeps alone.
        own[key] = full[name] if name in full else full["embedding.word_embeddings.weight"]
    stage.load_state_dict(own, strict=True)
    return stage


def _mixture(dtype: torch.dtype, tp: int, ep: int, etp: int | None = None) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, qk_layernorm=True, num_moe_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="allgather", hidden_dropout=0.0,
        attention_dropout=0.0, layernorm_epsilon=1e-6, persist_layer_norm=False, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=True)
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=64, max_sequence_length=32, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, rotary_base=10000)


def build_mixture(ep: int = 1, tp: int = 1, dtype: torch.dtype = torch.float32,
                  etp: int | None = None) -> torch.nn.Module:
    """A Qwen3-MoE-style mixture (q/k norms, four experts, two per token) split over ``tp`` tensor-parallel and
    ``ep`` expert-parallel ranks, the same weights at every split: each rank's experts are filled from the model
    built whole (expert-parallel ranks build their local experts alike, so the generator alone cannot tell them
    apart)."""
    import re

    from megatron.core import parallel_state as ps

    on_cpu()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp)
    seed_trackers(0, ps.get_tensor_model_parallel_rank())
    whole = _mixture(dtype, tp, 1, etp)
    if ep == 1:
        return whole
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    seed_trackers(0, ps.get_tensor_model_parallel_rank())
    split = _mixture(dtype, tp, ep)
    first = ps.get_expert_model_parallel_rank() * (4 // ep)
    full = whole.state_dict()
    own = {key: full[re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + first}.", key)]
           for key in split.state_dict()}
    split.load_state_dict(own, strict=True)
    return split
