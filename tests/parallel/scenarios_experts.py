"""Experts split over their own ranks beside FSDP2, as transformers makes them
(``DistributedConfig(fsdp_size=N, ep_size=2)``): every operation against the same checkpoint loaded whole."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.adapters.scenarios_foreign import saved
from tests.parallel.scenarios_pipeline import _same, _streamed, _whole_same, load_and_copy
from wrapkit.cli._families import family_model


def expert_ops(tmp: str, name: str, dtype: str = "float32", tp: int = 1) -> dict[str, Any]:
    """Every operation on ``name`` (a mixture-of-experts family) with its experts split over two ranks and
    everything sharded over all of them (``tp``: tensor parallelism over that many ranks beside it)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch_dtype = getattr(torch, dtype)
    directory = saved(tmp, name, lambda: family_model(name, 0))
    other = saved(tmp, f"{name}-other", lambda: family_model(name, 1))
    sizes = {"fsdp_size": dist.get_world_size() // tp, "ep_size": 2} | ({"tp_size": tp} if tp > 1 else {})
    split = DistributedConfig(**sizes)

    def whole(path: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, distributed_config=split)
    wm, ref = wrapkit.adapt(model), wrapkit.adapt(whole(directory))
    experts = next(m for m in model.modules() if getattr(m, "_is_expert_parallel", False))
    out: dict[str, Any] = {
        "backend": wm.backend, "describe": wm.describe(), "local_experts": experts.num_experts,
        "batches": (wm.data_parallel_rank, wm.data_parallel_size),
        "count": (wm.num_parameters(), ref.num_parameters()),
        "full_state_dict": _whole_same(wm, ref),
        "named_full_parameters": _same(dict((n, t.clone()) for n, t in wm.named_full_parameters()),
                                       dict(ref.named_full_parameters())),
        "stream": {layout: _same(_streamed(wm, layout), _streamed(ref, layout)) for layout in ("hub", "runtime")},
    }
    written = os.path.join(tmp, f"{name}-ep-saved-{dtype}-{dist.get_world_size()}-{tp}")
    wm.save_pretrained(written)
    out["save_pretrained"] = _same(whole(written).state_dict(), ref.unwrap().state_dict())

    tokens = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        want_logits = ref.module(input_ids=tokens).logits
    with wm.gathered() as m, torch.no_grad():
        # The full experts run the experts' own forward over all of them; their count is back on exit.
        out["gathered"] = ((m(input_ids=tokens).logits - want_logits).abs().max().item(), experts.num_experts)
    out["local_after"] = experts.num_experts
    want = ref.module.generate(tokens, max_new_tokens=4, do_sample=False)
    out["generation"] = {}
    for gather in ("full", "layerwise"):
        with wm.generation(gather=gather) as m:
            out["generation"][gather] = torch.equal(m.generate(tokens, max_new_tokens=4, do_sample=False), want)

    reference = wrapkit.prepare_reference(wm)
    out["reference"] = (reference.backend, any(p.requires_grad for p in reference.unwrap().parameters()),
                        _whole_same(reference, wm))

    out.update(load_and_copy(wm, ref, whole, directory, other)[0])
    report = wm.sleep()
    wm.wake()
    out["sleep"] = (report is not None, _whole_same(wm, ref))

    # One training step on the same batch: the split model's gradients are the whole model's.
    batch = torch.tensor([[2, 7, 1, 8, 2, 8]])
    for m in (model, ref.module):
        m.train()
        m(input_ids=batch, labels=batch).loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    mine, theirs = wm.full_state_dict(rank0_only=False), ref.full_state_dict(rank0_only=False)
    out["trained"] = max((mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs)
    return out


# -- experts on an 'ep' mesh dimension built by hand, as torchtitan lays them out --------------------------
class _Experts(torch.nn.Module):
    def __init__(self, n: int = 4, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(n, hidden, dim) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(n, dim, hidden) * 0.3)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            mask = idx == e
            out[mask] = torch.relu(x[mask] @ self.w1[e].T) @ self.w2[e].T
        return out


class _MoeBlock(torch.nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, 4, bias=False)
        self.experts = _Experts(dim=dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        idx = self.router(h).argmax(-1)
        return h + self.experts(h.reshape(-1, h.shape[-1]), idx.reshape(-1)).reshape(h.shape)


class TitanMoE(torch.nn.Module):
    """torchtitan's layout of a mixture: layers in a ModuleDict, each block's experts stacked on dimension 0."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = torch.nn.Embedding(32, 8)
        self.layers = torch.nn.ModuleDict({str(i): _MoeBlock() for i in range(2)})
        self.output = torch.nn.Linear(8, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h)


def _split_by_hand(model: TitanMoE) -> TitanMoE:
    """torchtitan's split over four ranks: the experts over an (efsdp=2, ep=2) mesh, each share sharded over
    its two ranks, and everything else sharded over all four (the same mesh flattened)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    root = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dense = root._flatten("dp_shard")
    for layer in model.layers.values():
        experts: Any = layer.experts
        for name in ("w1", "w2"):
            value = distribute_tensor(getattr(experts, name).detach(), root["ep"], [Shard(0)])
            setattr(experts, name, torch.nn.Parameter(value))
        fully_shard(experts, mesh=root["dp_shard_mod_ep"])
        fully_shard(layer, mesh=dense)
    fully_shard(model, mesh=dense)
    return model


def titan_expert_ops(tmp: str) -> dict[str, Any]:
    """Every operation on experts split by hand over an 'ep' mesh dimension beside FSDP2."""
    wm, whole = wrapkit.adapt(_split_by_hand(TitanMoE(0))), wrapkit.adapt(TitanMoE(0))
    out: dict[str, Any] = {
        "backend": wm.backend, "describe": wm.describe(), "count": (wm.num_parameters(), whole.num_parameters()),
        "placements": str(wm.unwrap().layers["0"].experts.w1.placements),
        "full_state_dict": _whole_same(wm, whole),
        "named_full_parameters": _same(dict((n, t.clone()) for n, t in wm.named_full_parameters()),
                                       dict(whole.named_full_parameters())),
        "stream": _same(_streamed(wm, "runtime"), _streamed(whole, "runtime")),
    }
    tokens = torch.arange(8).reshape(2, 4)
    with wm.gathered() as m, torch.no_grad():
        out["gathered"] = (m(tokens) - whole.module(tokens)).abs().max().item()
    other = wrapkit.adapt(TitanMoE(1))
    out["load_full_state_dict"] = (wm.load_full_state_dict(other.full_state_dict(rank0_only=False)),
                                   _whole_same(wm, other))
    directory = os.path.join(tmp, "titan-moe")
    wm.save_pretrained(directory)
    reloaded = wrapkit.adapt(TitanMoE(2))
    reloaded.load(directory)
    out["save_pretrained"] = _whole_same(reloaded, other)
    target = wrapkit.adapt(TitanMoE(3))
    wm.copy_to(target)
    out["copy_to"] = _whole_same(target, other)
    try:
        wrapkit.prepare_reference(wm)
        out["reference_copy"] = "not refused"
    except wrapkit.WrapkitError as exc:
        out["reference_copy"] = str(exc)
    reference = wrapkit.prepare_reference(wm, _split_by_hand(TitanMoE(1)))  # as loaded: the same values
    out["reference"] = (reference.backend, _whole_same(reference, other))
    return out
