"""Scenarios for models bigger than one device: layerwise generation, sharded checkpoints."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import PRECISIONS, build, ds_config, tiny_llama

PROMPT = (torch.arange(12).reshape(2, 6) * 7) % 128
LAYERS = 4


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _generate(m: torch.nn.Module, new_tokens: int) -> torch.Tensor:
    out: torch.Tensor = m.generate(  # type: ignore[operator]
        PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None)
    return out


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """What must be exactly the same after generation(): parameter objects, hooks, modes."""
    return {
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
        "modes": [m.training for m in model.modules()],
        "dicts": [sorted(k for k in m.__dict__ if k.startswith("_is_fsdp")) for m in model.modules()],
    }


def _lean_zero3(precision: str, seed: int = 0) -> torch.nn.Module:
    """ZeRO-3 that keeps nothing gathered between forwards and prefetches little: the setting
    for a model bigger than one device (the defaults keep parameters under 1e5 elements, all
    of a tiny model's, gathered for good)."""
    import deepspeed
    from deepspeed.utils import groups

    groups.mpu = None
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1,
            "stage3_max_live_parameters": 1}
    extra = {} if precision == "fp32" else {precision: {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=tiny_llama(seed, layers=LAYERS),
                                      config=ds_config(3, zero_optimization=zero, **extra))
    return engine  # type: ignore[no-any-return]


def build_scale(spec: str, precision: str = "fp32", topology: str = "flat", seed: int = 0) -> torch.nn.Module:
    if spec == "zero3":
        return _lean_zero3(precision, seed)
    return build(spec, model=tiny_llama(seed, layers=LAYERS), precision=precision, topology=topology)


def unit_bytes(precision: str) -> list[int]:
    """Bytes of each transformer block, and of everything outside the blocks, in the compute dtype."""
    model = tiny_llama(0, layers=LAYERS)
    size = PRECISIONS[precision].itemsize
    blocks = [sum(p.numel() for p in block.parameters()) * size for block in model.model.layers]
    return [*blocks, sum(p.numel() for p in model.parameters()) * size - sum(blocks)]


def layerwise(spec: str, precision: str, topology: str = "flat") -> dict[str, Any]:
    """gather="layerwise" against "full": the same logits and tokens, the same state afterwards,
    and a peak of parameter memory far below the gathered model."""
    model = build_scale(spec, precision, topology)
    wm = wrapkit.adapt(model)
    obs: dict[str, Any] = {"full_bytes": wm._below.gatherer.full_bytes(),  # type: ignore[attr-defined]
                           "rank": dist.get_rank()}
    before = _snapshot(model)
    with wm.generation(gather="full") as m:
        full_logits = _logits(m(input_ids=PROMPT))
        full_tokens = _generate(m, 6)
    peak = [0]

    def track(mod: torch.nn.Module, *args: Any) -> None:
        peak[0] = max(peak[0], wm.resident_parameter_bytes())

    obs["rest_bytes"] = wm.resident_parameter_bytes()
    try:
        with wm.generation(gather="layerwise") as m:
            # After each module's gathering hooks (registered first) and before its releasing ones.
            handles = [h for mod in m.modules()
                       for h in (mod.register_forward_pre_hook(track), mod.register_forward_hook(track))]
            try:
                obs["training_inside"] = any(x.training for x in m.modules())
                lw_logits = _logits(m(input_ids=PROMPT))
                lw_tokens = _generate(m, 6)
                # A rank that stops early keeps stepping while the other decodes (synced).
                obs["ragged"] = list(_generate(m, 3 + 3 * dist.get_rank()).shape)
            finally:
                for h in handles:
                    h.remove()
    except Exception as exc:  # reported, so every rank's failure is seen side by side
        obs["error"] = f"{type(exc).__name__}: {exc}"[:400]
        return obs
    try:  # a body that raises mid-generation leaves nothing behind either
        with wm.generation(gather="layerwise") as m:
            m(input_ids=PROMPT)
            raise KeyError("body")
    except KeyError:
        pass
    obs["peak_bytes"] = peak[0]
    obs["logits_diff"] = float((lw_logits.float() - full_logits.float()).abs().max())
    obs["dtypes"] = (str(full_logits.dtype), str(lw_logits.dtype))
    obs["same_tokens"] = bool(torch.equal(lw_tokens, full_tokens))
    obs["same_state"] = _snapshot(model) == before
    obs["after_bytes"] = wm.resident_parameter_bytes()
    # Training still works, and its forward gives the same logits as before.
    model.eval()
    with torch.no_grad():
        obs["own_diff"] = float((_logits(wm(input_ids=PROMPT)).float() - full_logits.float()).abs().max())
    model.train()
    return obs


def auto_choice(spec: str, budget: str | None) -> dict[str, Any]:
    """gather="auto" under a memory budget: full when the model fits, layerwise when it does not;
    gathered() refuses the model that does not fit, on every rank, with nothing changed."""
    wm = wrapkit.adapt(build_scale(spec))
    if budget is not None:
        os.environ["WRAPKIT_MEMORY_BUDGET"] = budget
    obs: dict[str, Any] = {}
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("wrapkit")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        full_tokens = None
        with wm.generation(gather="auto") as m:
            full_tokens = _generate(m, 4)
        obs["chosen"] = records
        try:
            with wm.gathered():
                obs["gathered"] = "entered"
        except wrapkit.PlacementError as exc:
            obs["gathered"] = str(exc)
        try:
            with wm.generation(gather="full"):
                obs["full"] = "entered"
        except wrapkit.PlacementError as exc:
            obs["full"] = str(exc)
        try:
            with wm.generation(gather="sideways" if dist.get_rank() == 1 else "auto"):
                obs["bad"] = "entered"
        except wrapkit.ArgumentError as exc:
            obs["bad"] = str(exc)
        with wm.generation(gather="layerwise") as m:
            obs["same_tokens"] = bool(torch.equal(_generate(m, 4), full_tokens))
        obs["training"] = wm.module.training
    finally:
        os.environ.pop("WRAPKIT_MEMORY_BUDGET", None)
        logger.removeHandler(handler)
        logger.setLevel(level)
    return obs


class _Records(logging.Handler):
    """The messages the package logs at ``level`` while in use."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []
        self.logger = logging.getLogger("wrapkit")

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Records:
        self.saved = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(self.level)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.saved)


def save_pretrained(spec: str, precision: str, path: str, shard_size: str, merge: bool = False) -> dict[str, Any]:
    """save_pretrained -> from_pretrained: the same values, bitwise, as full_state_dict(); files of at most
    shard_size, written by every rank, each holding at most one file."""
    wm = wrapkit.adapt(build_scale(spec, precision))
    sd = wm.full_state_dict(merge_adapters=merge)
    with _Records(logging.DEBUG) as records:
        wm.save_pretrained(path, max_shard_size=shard_size, merge_adapters=merge)
    obs: dict[str, Any] = {"written": [m for m in records.messages if m.startswith("save_pretrained")]}
    if dist.get_rank() == 0:
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        obs["files"] = sorted(os.listdir(path))
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        obs["index_files"] = sorted(set(index["weight_map"].values()))
        sizes = []
        for name in obs["index_files"]:
            with safe_open(os.path.join(path, name), "pt") as f:
                sizes.append(sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()))
        obs["file_bytes"] = sizes
        obs["total_size"] = index["metadata"]["total_size"]
        loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
        obs["same_keys"] = sorted(loaded) == sorted(sd)
        obs["bitwise"] = [k for k in sd if not (k in loaded and loaded[k].dtype == sd[k].dtype
                                                and torch.equal(loaded[k], sd[k]))]
        obs["entry_bytes"] = max(t.numel() * t.element_size() for t in sd.values())
    return obs


def _bitwise_as(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose values differ, ``want`` cast to the dtype ``got`` holds (a bf16 model keeps bf16)."""
    return [k for k in want if k not in got or not torch.equal(got[k], want[k].to(got[k].dtype))]


def cross_load(src_spec: str, precision: str, path: str, dst_specs: list[str]) -> dict[str, Any]:
    """A sharded checkpoint of one backend loads into every other, bitwise, each rank reading its
    slices (or rank 1 reading for all); the loaded model trains on."""
    src = wrapkit.adapt(build_scale(src_spec, precision))
    with src.gathered(modifier_rank=0) as m, torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype))
    want = src.full_state_dict(rank0_only=False)
    src.save_pretrained(path, max_shard_size="20KB")
    obs: dict[str, Any] = {}
    for i, dst in enumerate(dst_specs):
        wm = wrapkit.adapt(build_scale(dst, precision, seed=3))
        kwargs = {"src_rank": 1} if i % 2 else {}
        with _Records(logging.DEBUG) as records:
            wm.load(path, **kwargs)
        obs[f"{dst}_read"] = [m for m in records.messages if m.startswith("load:")]
        obs[dst] = _bitwise_as(wm.full_state_dict(rank0_only=False), want)
        model = wm.module
        out = _logits(model(input_ids=PROMPT))
        out.float().mean().backward()
        obs[f"{dst}_trains"] = bool(torch.isfinite(out).all())
    return obs


def hsdp_save(spec: str, path: str) -> dict[str, Any]:
    """save_pretrained on a multi-node layout: the first replica's ranks write, and the checkpoint
    loads into a flat model over all four ranks."""
    src = wrapkit.adapt(build_scale(spec, topology="hsdp"))
    want = src.full_state_dict(rank0_only=False)
    with _Records(logging.DEBUG) as records:
        src.save_pretrained(path, max_shard_size="20KB")
    flat = wrapkit.adapt(build_scale(spec, seed=5))
    flat.load(path)
    back = wrapkit.adapt(build_scale(spec, topology="hsdp", seed=6))
    back.load(path, src_rank=1)
    return {"written": records.messages, "flat": _bitwise_as(flat.full_state_dict(rank0_only=False), want),
            "hsdp": _bitwise_as(back.full_state_dict(rank0_only=False), want)}


def bad_checkpoints(spec: str, tmpdir: str) -> dict[str, Any]:
    """Incomplete and mistaken checkpoints and arguments: a typed error on every rank, nothing changed."""
    wm = wrapkit.adapt(build_scale(spec))
    before = wm.full_state_dict(rank0_only=False)
    good = os.path.join(tmpdir, f"{spec}-good")
    wm.save_pretrained(good, max_shard_size="20KB")
    obs: dict[str, Any] = {}

    def attempt(fn: Any) -> str:
        try:
            fn()
        except wrapkit.WrapkitError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    holed = os.path.join(tmpdir, f"{spec}-holed")
    if dist.get_rank() == 0:
        import shutil

        shutil.copytree(good, holed)
        os.unlink(os.path.join(holed, "model-00003-of-00012.safetensors"))
        with open(os.path.join(tmpdir, f"{spec}-file"), "w") as f:
            f.write("x")
    dist.barrier()
    obs["holed"] = attempt(lambda: wm.load(holed))
    obs["bad_src"] = attempt(lambda: wm.load(good, src_rank=5))
    # Only the reading rank finds out that the checkpoint is missing; every rank raises.
    obs["missing_src"] = attempt(lambda: wm.load(os.path.join(tmpdir, "nothing"), src_rank=1))
    obs["empty_dir"] = attempt(lambda: wm.load(tmpdir))
    obs["bad_size"] = attempt(lambda: wm.save_pretrained(os.path.join(tmpdir, "x"), max_shard_size="lots"))
    obs["onto_file"] = attempt(lambda: wm.save_pretrained(os.path.join(tmpdir, f"{spec}-file")))
    obs["no_parent"] = attempt(lambda: wm.save_pretrained(os.path.join(tmpdir, "no", "such")))
    obs["unchanged"] = _bitwise_as(wm.full_state_dict(rank0_only=False), before)
    obs["good_untouched"] = sorted(os.listdir(good)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json"]
        + [f"model-{k:05d}-of-00012.safetensors" for k in range(1, 13)])
    obs["leftovers"] = sorted(n for n in os.listdir(tmpdir) if ".wrapkit-" in n)
    return obs


# The script of a save killed midway: a previous checkpoint of seed 1, then a save of seed 2
# whose writer dies (SIGKILL, as an OOM kill would) after its first file.
KILLED_SAVE = """
import os, signal, sys
import wrapkit, wrapkit.formats.safetensors as st
from wrapkit.cli._models import tiny_llama
path, layers = sys.argv[1], int(sys.argv[2])
wrapkit.adapt(tiny_llama(1, layers=layers)).save_pretrained(path, max_shard_size="20KB")
write = st.write_file
def dying(tensors, file):
    write(tensors, file)
    os.kill(os.getpid(), signal.SIGKILL)
st.write_file = dying
wrapkit.adapt(tiny_llama(2, layers=layers)).save_pretrained(path, max_shard_size="20KB")
"""


def meta_load(kind: str, path: str) -> dict[str, Any]:
    """A model too big for one rank is never whole anywhere: created on the meta device (or
    partitioned at creation by zero.Init), sharded, then filled by load() from a checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from wrapkit.adapters.dtensor.sharding import fully_shard_per_block

    plain = tiny_llama(11, layers=LAYERS)
    if dist.get_rank() == 0:
        wrapkit.adapt(plain).save_pretrained(path, max_shard_size="20KB")
    dist.barrier()
    want = plain.state_dict()
    config = plain.config
    if kind == "fsdp2":
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        wrapped: torch.nn.Module = fully_shard_per_block(model, mesh)
    elif kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        with torch.device("meta"):
            model = LlamaForCausalLM(config)

        def init(module: torch.nn.Module) -> None:
            # What a trainer's param_init_fn does: storage on the device, buffers rebuilt.
            module.to_empty(device=torch.device("cpu"), recurse=False)
            if "RotaryEmbedding" in type(module).__name__:
                model._init_weights(module)

        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                           param_init_fn=init, use_orig_params=True, device_id=torch.device("cpu"))
    else:
        import deepspeed
        from deepspeed.utils import groups

        groups.mpu = None
        cfg = ds_config(3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = LlamaForCausalLM(config)
        wrapped, *_ = deepspeed.initialize(model=model, config=cfg)
    wm = wrapkit.adapt(wrapped)
    obs: dict[str, Any] = {"resident_before": wm.resident_parameter_bytes(), "full": 4 * wm.num_parameters()}
    wm.load(path)
    obs["resident_after"] = wm.resident_parameter_bytes()
    got = wm.full_state_dict(rank0_only=False)
    obs["diff"] = _bitwise_as(got, want)
    with torch.no_grad():
        obs["logits"] = float((_logits(wm(input_ids=PROMPT)) - _logits(plain(input_ids=PROMPT))).abs().max())
    return obs


def view_save(path: str) -> dict[str, Any]:
    """The adapter-disabled reference of a PEFT policy saves the base model, loadable by its own class."""
    policy = wrapkit.adapt(build("fsdp2>peft", model=tiny_llama(0, layers=LAYERS)))
    ref = wrapkit.prepare_reference(policy)
    want = ref.full_state_dict(rank0_only=False)
    ref.save_pretrained(path, max_shard_size="20KB")
    obs: dict[str, Any] = {"view": type(ref).__name__}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
        obs["same_keys"] = sorted(loaded) == sorted(want)
        obs["diff"] = _bitwise_as(loaded, want)
        obs["files"] = sorted(os.listdir(path))
    return obs


def bad_devices(spec: str) -> dict[str, Any]:
    """place() with what is not a usable device: a PlacementError on every rank, nothing moved,
    also when only one rank passes it."""
    wm = wrapkit.adapt(build(spec))
    obs: dict[str, Any] = {}
    for label, device in (("cuda", "cuda"), ("string", "not-a-device"), ("float", 2.5),
                          ("one_rank", "cuda:3" if dist.get_rank() == 1 else "cpu")):
        try:
            wm.place(device)
            obs[label] = "no error"
        except wrapkit.PlacementError as exc:
            obs[label] = str(exc)
        obs[f"{label}_devices"] = sorted({str(t.device) for _, t in wrapkit.adapt(wm)._below.placement.tensors()})
    return obs
