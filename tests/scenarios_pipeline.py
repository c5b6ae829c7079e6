"""transformers' pipeline stages (``DistributedConfig(pp_size=2)``) on two gloo ranks: every operation against
the same checkpoint loaded whole on every rank."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._families import family_model
from wrapkit.cli._models import tiny_llama


def _saved(tmp: str, name: str, build: Callable[[], torch.nn.Module]) -> str:
    directory = os.path.join(tmp, name)
    if dist.get_rank() == 0 and not os.path.isdir(directory):
        build().save_pretrained(directory)
    dist.barrier()
    return directory


def _model(name: str, seed: int) -> torch.nn.Module:
    return tiny_llama(seed, layers=4) if name == "llama4" else family_model(name, seed)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """What differs between two state dicts: keys (in order), then values."""
    if list(a) != list(b):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return [f"keys differ from position {first}: {list(a)[first:first + 3]} != {list(b)[first:first + 3]}; "
                f"only in the first: {sorted(set(a) - set(b))}, only in the second: {sorted(set(b) - set(a))}"]
    return [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]


def _whole_same(a: Any, b: Any) -> list[str]:
    return _same(a.full_state_dict(rank0_only=False), b.full_state_dict(rank0_only=False))


def _streamed(wm: Any, layout: str) -> dict[str, torch.Tensor]:
    # By name: a whole model's buckets pack a tied weight's names together, a pipeline's in the stages' order.
    return dict(sorted((n, t.clone()) for bucket in wm.stream_full_parameters(bucket_bytes=4096, layout=layout)
                       for n, t in bucket.named_tensors()))


def _refused(call: Callable[[], Any]) -> str:
    try:
        call()
    except wrapkit.UnsupportedModelError as exc:
        return str(exc)
    return "not refused"


def pipeline_ops(tmp: str, name: str, dtype: str = "float32") -> dict[str, Any]:
    """Every operation on the stages of ``name`` (a family, or ``llama4``: four layers, two per stage)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch_dtype = getattr(torch, dtype)
    directory = _saved(tmp, name, lambda: _model(name, 0))
    other = _saved(tmp, f"{name}-other", lambda: _model(name, 1))

    def whole(path: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)

    pp = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype,
                                              distributed_config=DistributedConfig(pp_size=2))
    wm = wrapkit.adapt(pp)
    ref = wrapkit.adapt(whole(directory))
    out: dict[str, Any] = {
        "backend": wm.backend, "sharded": wm.is_sharded, "world": (wm.rank, wm.world_size),
        "batches": (wm.data_parallel_rank, wm.data_parallel_size), "describe": wm.describe(),
        "held": sorted(n for n, _ in pp.named_parameters()),
        "count": (wm.num_parameters(), ref.num_parameters()),
    }
    # Freeze the embedding (stage 0's) and the final norm (the last stage's): counted where they are.
    for m in (pp, ref.module):
        for n, p in m.named_parameters():
            p.requires_grad_(not (n.startswith("model.embed_tokens") or n.startswith("model.norm")))
    out["trainable"] = (wm.num_parameters(trainable_only=True), ref.num_parameters(trainable_only=True))
    for m in (pp, ref.module):
        m.requires_grad_(True)

    out["full_state_dict"] = _whole_same(wm, ref)
    out["rank0_only"] = sorted(wm.full_state_dict()) == sorted(ref.full_state_dict()) if wm.rank == 0 else \
        wm.full_state_dict() == {}
    out["named_full_parameters"] = _same(dict((n, t.clone()) for n, t in wm.named_full_parameters()),
                                         dict(ref.named_full_parameters()))
    out["stream"] = {layout: _same(_streamed(wm, layout), _streamed(ref, layout)) for layout in ("hub", "runtime")}

    saved = os.path.join(tmp, f"{name}-saved-{dtype}")
    wm.save_pretrained(saved)
    out["save_pretrained"] = _same(whole(saved).state_dict(), ref.unwrap().state_dict())

    tokens = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        logits = pp(input_ids=tokens).logits
    out["forward"] = (logits - ref.module(input_ids=tokens).logits).abs().max().item()
    with wm.generation() as m:
        greedy = m.generate(tokens, max_new_tokens=4, do_sample=False)
    out["greedy"] = torch.equal(greedy, ref.module.generate(tokens, max_new_tokens=4, do_sample=False))
    torch.manual_seed(100 + dist.get_rank())  # each rank its own generator: the stages must still agree
    with wm.generation(gather="auto") as m:
        out["sampled"] = m.generate(tokens, max_new_tokens=4, do_sample=True, top_k=0).tolist()

    out["gathered"] = _refused(lambda: wm.gathered().__enter__())
    out["generation_full"] = _refused(lambda: wm.generation(gather="full").__enter__())
    reference = wrapkit.prepare_reference(wm)
    with torch.no_grad():
        ref_logits = reference(input_ids=tokens).logits
    out["reference"] = (reference.backend, any(p.requires_grad for p in reference.unwrap().parameters()),
                        _whole_same(reference, wm), (ref_logits - logits).abs().max().item(),
                        any(p.data_ptr() == q.data_ptr() for p, q in zip(reference.unwrap().parameters(),
                                                                         pp.parameters(), strict=True)))

    # A load gives each stage its own layers; copy_to goes both ways with a whole model.
    changed = wrapkit.adapt(whole(other))
    out["load"] = (wm.load(other), _whole_same(wm, changed))
    target = wrapkit.adapt(whole(directory))
    wm.copy_to(target)
    out["copy_to_whole"] = _whole_same(target, changed)
    ref.copy_to(wm)
    out["copy_from_whole"] = _whole_same(wm, ref)

    # And with a model sharded another way: FSDP2 over the same two ranks.
    from torch.distributed.fsdp import fully_shard

    sharded = wrapkit.adapt(fully_shard(whole(directory)))
    wm.copy_to(sharded)
    out["copy_to_fsdp2"] = _whole_same(sharded, ref)
    changed.copy_to(sharded)
    sharded.copy_to(wm)
    out["copy_from_fsdp2"] = _whole_same(wm, changed)
    ref.copy_to(wm)

    report = wm.sleep()
    wm.wake()
    out["sleep"] = (report is not None, _whole_same(wm, ref))
    return out
