"""transformers' pipeline stages (``DistributedConfig(pp_size=2)``) on two gloo ranks: every operation against
the same checkpoint loaded whole on every rank."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.adapters.scenarios_foreign import saved
from wrapkit.cli._families import family_model
from wrapkit.cli._models import tiny_llama


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


def load_and_copy(wm: Any, ref: Any, whole: Callable[[str], Any], directory: str,
                  other: str) -> tuple[dict[str, Any], Any]:
    """``wm`` loaded from ``other`` (a checkpoint directory), copied into a whole model built from ``directory``,
    then given ``ref``'s values by ``copy_to``: what each gave against the whole model, and the model ``other``
    holds (adapted), for what follows."""
    changed = wrapkit.adapt(whole(other))
    out = {"load": (wm.load(other), _whole_same(wm, changed))}
    target = wrapkit.adapt(whole(directory))
    wm.copy_to(target)
    out["copy_to_whole"] = _whole_same(target, changed)
    ref.copy_to(wm)
    out["copy_from_whole"] = _whole_same(wm, ref)
    return out, changed


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
    directory = saved(tmp, name, lambda: _model(name, 0))
    other = saved(tmp, f"{name}-other", lambda: _model(name, 1))

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

    written = os.path.join(tmp, f"{name}-saved-{dtype}")
    wm.save_pretrained(written)
    out["save_pretrained"] = _same(whole(written).state_dict(), ref.unwrap().state_dict())

    tokens = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        logits = pp(input_ids=tokens).logits
    out["forward"] = (logits - ref.module(input_ids=tokens).logits).abs().max().item()
    want = ref.module.generate(tokens, max_new_tokens=4, do_sample=False)
    out["greedy"], out["sampled"] = {}, {}
    # "layerwise": the pipeline's own forward, every stage stepping; "full": the whole model built on every rank.
    for gather in ("layerwise", "full"):
        with wm.generation(gather=gather) as m:
            out["greedy"][gather] = (m is pp, torch.equal(m.generate(tokens, max_new_tokens=4, do_sample=False), want))
        torch.manual_seed(100 + dist.get_rank())  # each rank its own generator: the stages must still agree
        with wm.generation(gather=gather) as m:
            out["sampled"][gather] = m.generate(tokens, max_new_tokens=4, do_sample=True, top_k=0).tolist()

    with wm.gathered() as m:
        with torch.no_grad():
            gathered_logits = m(input_ids=tokens).logits
        out["gathered"] = (m is pp, _same(m.state_dict(), ref.unwrap().state_dict()),
                           (gathered_logits - ref.module(input_ids=tokens).logits).abs().max().item())
    # A change made on rank 0 (stage 0) to the last stage's norm reaches the stage holding it.
    with wm.gathered(modifier_rank=0) as m, torch.no_grad():
        if dist.get_rank() == 0:
            dict(m.named_parameters())["model.norm.weight"].add_(1.0)
    changed_norm = ref.full_state_dict(rank0_only=False)
    changed_norm["model.norm.weight"] = changed_norm["model.norm.weight"] + 1.0
    out["modified"] = _same(wm.full_state_dict(rank0_only=False), changed_norm)
    ref.copy_to(wm)
    reference = wrapkit.prepare_reference(wm)
    with torch.no_grad():
        ref_logits = reference(input_ids=tokens).logits
    out["reference"] = (reference.backend, any(p.requires_grad for p in reference.unwrap().parameters()),
                        _whole_same(reference, wm), (ref_logits - logits).abs().max().item(),
                        any(p.data_ptr() == q.data_ptr() for p, q in zip(reference.unwrap().parameters(),
                                                                         pp.parameters(), strict=True)))

    # A load gives each stage its own layers; copy_to goes both ways with a whole model.
    copies, changed = load_and_copy(wm, ref, whole, directory, other)
    out.update(copies)

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


# -- torch.distributed.pipelining, a model cut as torchtitan cuts one --------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))  # persistent: in every export

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * self.scale


class TitanLike(torch.nn.Module):
    """torchtitan's layout: the layers in a ModuleDict under their global numbers, and ends a stage can empty."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.tok_embeddings: torch.nn.Module | None = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleDict({str(i): _Block(dim) for i in range(layers)})
        self.norm: torch.nn.Module | None = torch.nn.LayerNorm(dim)
        self.output: torch.nn.Module | None = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _titan(seed: int) -> TitanLike:
    torch.manual_seed(seed)
    return TitanLike()


def _cut(model: TitanLike, stage: int) -> TitanLike:
    """The two-stage split torchtitan makes: layers 0-1 and the embedding, layers 2-3 with the norm and head."""
    keep = {0: ("0", "1"), 1: ("2", "3")}[stage]
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if stage == 0:
        model.norm = model.output = None
    else:
        model.tok_embeddings = None
    return model


def torch_pipeline_ops(tmp: str, wrap: str = "none") -> dict[str, Any]:
    """Every operation on a ``PipelineStage`` (one per rank), and one training step of a GPipe schedule against the
    same step on the whole model. ``wrap``: "none" (two ranks, one per stage), or "fsdp2" / "ddp" (four ranks,
    torchtitan's (pp, dp) mesh: each stage sharded or replicated over its two dp ranks, which take their own
    batches)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    rank, dp, dp_rank, pp_group = dist.get_rank(), 1, 0, None
    module = inner = _cut(_titan(0), rank if wrap == "none" else rank // 2)
    if wrap != "none":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
        inner = module = _cut(_titan(0), mesh.get_local_rank("pp"))
        dp, dp_rank, pp_group = mesh.size(1), mesh.get_local_rank("dp"), mesh.get_group("pp")
        if wrap == "fsdp2":
            for block in module.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
        else:
            module = DistributedDataParallel(module, process_group=mesh.get_group("dp"))
    s = dist.get_rank(pp_group)
    whole = wrapkit.adapt(_titan(0))
    stage = PipelineStage(module, stage_index=s, num_stages=2, device=torch.device("cpu"), group=pp_group)
    wm = wrapkit.adapt(stage)
    out: dict[str, Any] = {"backend": wm.backend, "stack": wm.stack, "module": wm.unwrap() is inner,
                           "batches": (wm.data_parallel_rank, wm.data_parallel_size), "stage": s,
                           "count": (wm.num_parameters(), whole.num_parameters()),
                           "full_state_dict": _whole_same(wm, whole),
                           "named_full_parameters": _same(dict((n, t.clone()) for n, t in wm.named_full_parameters()),
                                                          dict(whole.named_full_parameters())),
                           "stream": _same(_streamed(wm, "runtime"), _streamed(whole, "runtime"))}
    other = wrapkit.adapt(_titan(1))
    out["load_full_state_dict"] = (wm.load_full_state_dict(other.full_state_dict(rank0_only=False)),
                                   _whole_same(wm, other))
    path = os.path.join(tmp, "titan.safetensors")
    whole.save(path) if rank == 0 else None
    dist.barrier()
    out["load"] = (wm.load(path), _whole_same(wm, whole))
    target = wrapkit.adapt(_titan(2))
    wm.copy_to(target)
    out["copy_to"] = _whole_same(target, whole)
    directory = os.path.join(tmp, f"titan-{wrap}")
    wm.save_pretrained(directory)
    reloaded = wrapkit.adapt(_titan(3))
    reloaded.load(directory)
    out["save_pretrained"] = _whole_same(reloaded, whole)
    if wrap != "none":  # an operation is agreed over every rank of every stage, not only within a stage
        size = "1MB" if rank == 3 else "2MB"
        try:
            wm.save_pretrained(os.path.join(tmp, "mismatch"), max_shard_size=size)
            out["mismatch"] = "not refused"
        except wrapkit.DistributedStateError as exc:
            out["mismatch"] = str(exc)
    out["describe"] = wm.describe()
    out["gathered"] = _refused(lambda: wm.gathered().__enter__())  # no config: the whole model cannot be built
    if wrap == "fsdp2":  # a sharded stage is not copied: the reference comes cut and sharded as the policy is
        out["copy_refused"] = _refused(lambda: wrapkit.prepare_reference(wm))
        ref_module = _cut(_titan(0), s)
        for block in ref_module.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(ref_module, mesh=mesh["dp"])
        ref_stage = PipelineStage(ref_module, stage_index=s, num_stages=2, device=torch.device("cpu"), group=pp_group)
        reference = wrapkit.prepare_reference(wm, ref_stage)
    else:
        reference = wrapkit.prepare_reference(wm)
    out["reference"] = (reference.backend, any(p.requires_grad for p in reference.unwrap().parameters()),
                        _whole_same(reference, wm))

    # One step: the schedule on the stages, each dp rank with its own batch; the same batches and optimizer on
    # the whole model.
    tokens = torch.arange(16 * dp).reshape(4 * dp, 4) % 32
    targets = (tokens + 1) % 32
    mine_in, mine_out = tokens.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), target.reshape(-1))

    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    if s == 0:
        schedule.step(mine_in)
    else:
        schedule.step(target=mine_out, losses=losses)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    plain = whole.module
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    # Each dp rank's loss is the mean of its two microbatches'; the gradients are averaged over the dp ranks.
    quarters = [loss_fn(plain(t), y) / (2 * dp) for t, y in zip(tokens.chunk(2 * dp), targets.chunk(2 * dp),
                                                               strict=True)]
    sum(quarters).backward()  # type: ignore[union-attr]
    plain_opt.step()
    mine, want = wm.full_state_dict(rank0_only=False), whole.full_state_dict(rank0_only=False)
    out["trained"] = (list(mine) == list(want), max((mine[k] - want[k]).abs().max().item() for k in want))
    out["loss"] = (sum(x.item() for x in losses) / 2 - 2 * dp * sum(q.item() for q in quarters[2 * dp_rank:][:2])
                   / 2) if losses else None
    out["state"] = _stage_state(tmp, wrap, wm, inner, optimizer, other)
    return out


def _momenta(module: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    return {n: (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)(optimizer.state[p]["momentum_buffer"])
            for n, p in module.named_parameters() if p in optimizer.state}


def _stage_state(tmp: str, wrap: str, wm: Any, inner: torch.nn.Module, optimizer: Any, other: Any) -> dict[str, Any]:
    """save_state of the stages (each stage's optimizer its own layers), read into the whole model and back into the
    stages after their weights changed: weights, momenta and the learning rate."""
    directory = os.path.join(tmp, f"state-{wrap}")
    wm.save_state(directory, optimizer)
    saved, momenta = wm.full_state_dict(rank0_only=False), _momenta(inner, optimizer)
    whole = wrapkit.adapt(_titan(5))
    plain_opt = torch.optim.SGD(whole.module.parameters(), lr=0.5, momentum=0.9)
    whole.load_state(directory, plain_opt)
    theirs = _momenta(whole.module, plain_opt)
    out: dict[str, Any] = {"whole": _same(whole.full_state_dict(rank0_only=False), saved),
                           "whole_momenta": len(momenta) > 0 and all(torch.equal(theirs[n], m)
                                                                     for n, m in momenta.items()),
                           "whole_lr": [g["lr"] for g in plain_opt.param_groups]}
    wm.load_full_state_dict(other.full_state_dict(rank0_only=False))
    for m in optimizer.state.values():
        m["momentum_buffer"].zero_()
    wm.load_state(directory, optimizer)
    mine = _momenta(inner, optimizer)
    out["stages"] = _same(wm.full_state_dict(rank0_only=False), saved)
    out["stage_momenta"] = all(torch.equal(mine[n], m) for n, m in momenta.items())
    return out


def torch_pipeline_refusals() -> dict[str, str]:
    """Stages this adapter cannot read: a ModuleList that lost layers (renumbered), several stages per rank, a stage
    inside a wrapper other than FSDP2 or DDP."""
    from torch.distributed.pipelining import PipelineStage

    rank = dist.get_rank()
    out: dict[str, str] = {}
    cut = tiny_llama(0, layers=4)
    del cut.model.layers[(2 if rank == 0 else 0):(4 if rank == 0 else 2)]
    out["renumbered"] = _refused(lambda: wrapkit.adapt(PipelineStage(cut, rank, 2, torch.device("cpu"))))
    virtual = PipelineStage(_cut(_titan(0), 0), stage_index=2 * rank, num_stages=4, device=torch.device("cpu"))
    out["virtual"] = _refused(lambda: wrapkit.adapt(virtual))
    # A stage inside a wrapper whose copies wrapkit cannot place along the stages.
    wrapped = torch.nn.DataParallel(_cut(_titan(0), rank))
    out["dataparallel"] = _refused(lambda: wrapkit.adapt(PipelineStage(wrapped, rank, 2, torch.device("cpu"))))
    return out


def pipeline_peft(tmp: str) -> dict[str, Any]:
    """LoRA on transformers' stages: exports exact, merged or not (every stage's LoRA layers joined), and the
    adapters alone saved and loaded back."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    directory = saved(tmp, "llama4", lambda: _model("llama4", 0))
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(3)  # the same random adapters on every rank
    whole = get_peft_model(AutoModelForCausalLM.from_pretrained(directory), config)
    staged = AutoModelForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(pp_size=2))
    pp = get_peft_model(staged, config)
    values = whole.state_dict()
    with torch.no_grad():  # the same adapter values on both
        for name, p in pp.named_parameters():
            p.copy_(values[name])
    wm, ref = wrapkit.adapt(pp), wrapkit.adapt(whole)
    out = {"backend": wm.backend, "unmerged": _whole_same(wm, ref),
           "merged": _same(wm.full_state_dict(rank0_only=False, merge_adapters=True),
                           ref.full_state_dict(rank0_only=False, merge_adapters=True)),
           }
    # The adapters alone: every stage's, in PEFT's layout; loaded back into stages whose adapters differ.
    from peft import PeftModel

    adapters = os.path.join(tmp, "lora")
    wm.save_pretrained(adapters, adapters_only=True)
    lora = {k: v for k, v in whole.state_dict().items() if "lora_" in k}
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), adapters)
    out["adapters_only"] = _same({k: v for k, v in loaded.state_dict().items() if "lora_" in k}, lora)
    torch.manual_seed(4)
    other = wrapkit.adapt(get_peft_model(AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(pp_size=2)), config))
    result = other.load(adapters)
    mine = other.full_state_dict(rank0_only=False)
    out["adapters_loaded"] = (result.missing_keys, result.unexpected_keys,
                              _same({k: v for k, v in mine.items() if "lora_" in k}, lora))

    def streamed(model: Any) -> dict[str, torch.Tensor]:
        return {n: t.clone() for bucket in model.stream_full_parameters(merge_adapters=True)
                for n, t in bucket.named_tensors()}

    out["streamed_merged"] = _same(streamed(wm), streamed(ref))
    written = os.path.join(tmp, "lora-merged")
    wm.save_pretrained(written, merge_adapters=True)
    out["saved_merged"] = _same(AutoModelForCausalLM.from_pretrained(written).state_dict(),
                                whole.merge_and_unload().state_dict())
    return out
