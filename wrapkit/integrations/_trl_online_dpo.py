"""TRL's online DPO (``trl.experimental.online_dpo``) sending its weights to vLLM through wrapkit's stream.

``OnlineDPOTrainer._move_model_to_vllm`` walks the wrappers itself, apart from ``VLLMGeneration``'s: FSDP1 units
summoned one by one, FSDP2's ``full_tensor()`` per parameter, ZeRO-3 gathered per parameter, and for PEFT every
parameter gathered at once and ``merge_adapter()`` run in place (on FSDP1's flat shards it raises; elsewhere it moves
the frozen base weights by rounding). Under ``patch_trl()`` the policy is read through its adapter instead
(``vllm_weights``: the Hub's layout, each tied weight once, LoRA folded bucket by bucket without touching the live
weights), into the in-process engine's ``load_weights`` (colocate mode) or TRL's client on the main process (server
mode), or through wrapkit's ``VLLMEngine`` on every rank with ``patch_trl(vllm_server=True)``.

Its colocate engine is built inside the trainer's constructor: on vLLM's CPU build the constructor runs after
``colocated_cpu()`` (layers that can be reloaded), and the experts of a mixture are packed again after each sync.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Any

from ._trl_server import Replaced, colocated_cpu, colocated_loaded, serving_engine
from ._trl_sync import prepared_policy, vllm_weights

__all__ = ["online_dpo_methods"]

_MODULE = "trl.experimental.online_dpo.online_dpo_trainer"


class OnlineDPOSync(Replaced):
    """The two methods of ``OnlineDPOTrainer`` ``patch_trl()`` wraps."""

    def init(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """TRL's constructor, after ``colocated_cpu()`` where it builds a colocated engine; with ``server`` set, a
        ``VLLMEngine`` joined to the server's transfer group on every rank (``trainer.wrapkit_engine``)."""
        original = self.originals["__init__"]
        config: Any = inspect.signature(original).bind(trainer, *args, **kwargs).arguments.get("args")
        mode = getattr(config, "vllm_mode", None) if getattr(config, "use_vllm", False) else None
        if mode == "colocate":
            colocated_cpu()
        if mode != "server" or not self.server:
            original(trainer, *args, **kwargs)
            return
        # TRL's client generates; the weights go through wrapkit's engine, so the client must not join the server's
        # transfer group itself (TRL's constructor has it do so with NCCL).
        module: Any = importlib.import_module(_MODULE)
        client = module.VLLMClient
        module.VLLMClient = type("GenerationClient", (client,), {"init_communicator": _no_communicator})
        try:
            original(trainer, *args, **kwargs)
        finally:
            module.VLLMClient = client
        url = config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"
        trainer.wrapkit_engine = serving_engine(trainer.accelerator, url, config.vllm_group_port, self.timeout)

    def move_model_to_vllm(self, trainer: Any) -> None:
        """One update of the engine from the policy as the trainer trains it, then its prefix cache reset."""
        engine = getattr(trainer, "wrapkit_engine", None)
        if engine is not None:  # checked: version, prefix cache reset, every rank told the outcome
            wm = prepared_policy(trainer.model, trainer.accelerator)
            engine.sync(wm, merge_adapters="peft" in wm.stack)
            return
        accelerator = trainer.accelerator
        if trainer.vllm_mode == "colocate":
            model = trainer.llm.llm_engine.model_executor.driver_worker.model_runner.model
            # One tensor at a time: each is a view into the current bucket, valid until the next is taken.
            for name, tensor in vllm_weights(trainer.model, accelerator):
                model.load_weights([(name, tensor)])
            colocated_loaded(model)
            trainer.llm.reset_prefix_cache()
            return
        stream = vllm_weights(trainer.model, accelerator, to_rank=0)
        if not accelerator.is_main_process:
            for _ in stream:  # the other ranks take part in the gathers
                pass
            return
        client = trainer.vllm_client
        # One announced update for the whole model where the client has it (TRL 1.x; 0.29's pushes each alone).
        update = getattr(client, "weight_update", contextlib.nullcontext)
        with update():
            for name, tensor in stream:
                client.update_named_param(name, tensor)
        client.reset_prefix_cache()


def _no_communicator(self: Any, *args: Any, **kwargs: Any) -> None:
    """TRL's client joins no transfer group: wrapkit's ``VLLMEngine`` sends the weights."""


def online_dpo_methods(timeout: float, server: bool) -> list[tuple[type, str, Any]]:
    """``(OnlineDPOTrainer, name, drop-in)`` for its constructor and ``_move_model_to_vllm``, where this TRL has the
    trainer; none where they are wrapkit's already (``server`` is then turned on, if asked, until undone)."""
    try:
        owner = importlib.import_module(_MODULE).OnlineDPOTrainer
    except (ImportError, AttributeError):  # an older TRL, or one whose optional dependencies are missing
        return []
    names = ("__init__", "_move_model_to_vllm")
    if any(name not in owner.__dict__ for name in names):
        return []
    installed = getattr(owner.__dict__["_move_model_to_vllm"], "wrapkit_online_dpo", None)
    if installed is not None:
        installed.ask(timeout, server)
        return []
    sync = OnlineDPOSync({name: owner.__dict__[name] for name in names}, timeout, server)

    @functools.wraps(owner.__dict__["__init__"])
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        sync.init(self, *args, **kwargs)

    @functools.wraps(owner.__dict__["_move_model_to_vllm"])
    def _move_model_to_vllm(self: Any) -> None:
        sync.move_model_to_vllm(self)

    _move_model_to_vllm.wrapkit_online_dpo = sync  # type: ignore[attr-defined]
    return [(owner, "__init__", __init__), (owner, "_move_model_to_vllm", _move_model_to_vllm)]
