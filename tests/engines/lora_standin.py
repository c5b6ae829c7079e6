"""A stand-in for the LoRA routes of a vLLM 0.33 or an SGLang 0.5.23 server, in a process of its own.

Written from their released source:
- vLLM (``entrypoints/serve/lora/``, ``entrypoints/openai/models/serving.py``): ``/v1/load_lora_adapter``
  ``{lora_name, lora_path, load_inplace, is_3d_lora_weight}`` reads a PEFT directory; both names required, the
  base model's name refused, a loaded name refused unless ``load_inplace``; success is HTTP 200 with a plain-text
  body, a refusal ``{"error": {"message", "type", "code"}}``; ``/v1/unload_lora_adapter`` answers 404 for a name
  it does not hold; an adapter with LoRA on fused 3-D experts needs ``is_3d_lora_weight``.
- SGLang (``entrypoints/http_server.py``, ``managers/tp_worker.py``, ``utils/common.py``):
  ``/load_lora_adapter_from_tensors`` takes one pickled copy of the tensors per tensor-parallel rank (base64),
  each rank unpickles its own with a restricted unpickler, checks ``expected_checksums`` (SHA-256 of each
  tensor's bytes) and builds the adapter from ``config_dict``; answers ``{success, error_message,
  loaded_adapters}``; ``/unload_lora_adapter``.
- Both list the base model and every loaded adapter at ``GET /v1/models``.

Each adapter is loaded into a PEFT model over a transformers model of the configured family (seeded, so the
trainer can build the same base), strictly: every LoRA tensor of that model must arrive.

    python tests/engines/lora_standin.py --port P

prints ``ready`` once it listens. Routes of its own: ``/standin_mode {"engine", "family", "seed", "tp",
"refuse"}`` resets it; ``/standin_logits {"name", "path"}`` saves the logits of adapter ``name`` on the family's
test inputs; ``/standin_calls`` answers the calls received.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import os
import pickle
from typing import Any

import torch

from wrapkit.cli._families import family_inputs, family_model

BASE = "base-model"


class _Unpickler(pickle.Unpickler):
    """The globals SGLang's ``SafeUnpickler`` lets a plain pickle of CPU tensors use (others are refused)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")}:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


class Engine:
    def __init__(self) -> None:
        self.standin_mode({})

    def standin_mode(self, req: dict[str, Any]) -> tuple[int, Any]:
        self.engine = req.get("engine", "vllm")
        self.base = family_model(req.get("family", "llama"), seed=req.get("seed", 0)).eval()
        self.tp, self.refuse = req.get("tp", 1), req.get("refuse")
        self.adapters: dict[str, tuple[str, torch.nn.Module]] = {}
        self.calls: list[str] = []
        return 200, {"success": True}

    def handle(self, method: str, route: str, req: dict[str, Any]) -> tuple[int, Any]:
        self.calls.append(route)
        if route == self.refuse:
            return self._refusal(f"{route} refused by the stand-in", 400)
        if method == "GET" and route == "v1/models":
            cards = [{"id": BASE, "object": "model", "root": BASE}]
            cards += [{"id": n, "object": "model", "root": path, "parent": BASE}
                      for n, (path, _) in self.adapters.items()]
            return 200, {"object": "list", "data": cards}
        handler = getattr(self, route.replace("v1/", "vllm_") if route.startswith("v1/") else route, None)
        if method != "POST" or handler is None:
            return 404, {"detail": "Not Found"}
        return handler(req)  # type: ignore[no-any-return]

    def _refusal(self, message: str, code: int) -> tuple[int, Any]:
        if self.engine == "vllm":
            return code, {"error": {"message": message, "type": "InvalidUserInput", "code": code}}
        return code, {"success": False, "error_message": message, "loaded_adapters": self._loaded()}

    def _loaded(self) -> dict[str, str]:
        return {n: path for n, (path, _) in self.adapters.items()}

    def _strict(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        from peft import PeftConfig, get_peft_model, set_peft_model_state_dict
        from peft.utils import get_peft_model_state_dict

        model = get_peft_model(copy.deepcopy(self.base), PeftConfig.from_peft_type(**config))
        wanted = set(get_peft_model_state_dict(model))
        if set(tensors) != wanted:
            raise ValueError(f"adapter tensors do not match the model's LoRA layers: missing "
                             f"{sorted(wanted - set(tensors))[:3]}, unexpected {sorted(set(tensors) - wanted)[:3]}")
        set_peft_model_state_dict(model, tensors)
        return model.eval()

    # -- vLLM ---------------------------------------------------------------------------------------
    def vllm_load_lora_adapter(self, req: dict[str, Any]) -> tuple[int, Any]:
        name, path = req.get("lora_name"), req.get("lora_path")
        if self.engine != "vllm":
            return 404, {"detail": "Not Found"}
        if not name or not path:
            return self._refusal("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name == BASE:
            return self._refusal(f"The lora adapter '{name}' conflicts with a served base model.", 400)
        if not req.get("load_inplace") and name in self.adapters:
            return self._refusal(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                 "adapter in place, set 'load_inplace' to True.", 400)
        try:
            from safetensors.torch import load_file

            with open(os.path.join(path, "adapter_config.json")) as f:
                config = json.load(f)
            if config.get("target_parameters") and not req.get("is_3d_lora_weight"):
                raise ValueError("LoRA adapter contains fused 3D MoE weights, but the model uses a 2D MoE LoRA "
                                 "wrapper; set is_3d_lora_weight=True on the LoRA request.")
            model = self._strict(config, load_file(os.path.join(path, "adapter_model.safetensors")))
        except Exception as exc:
            return 500, {"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}
        self.adapters[name] = (path, model)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def vllm_unload_lora_adapter(self, req: dict[str, Any]) -> tuple[int, Any]:
        name = req.get("lora_name")
        if name not in self.adapters:
            return self._refusal(f"The lora adapter '{name}' cannot be found.", 404)
        del self.adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    # -- SGLang -------------------------------------------------------------------------------------
    def load_lora_adapter_from_tensors(self, req: dict[str, Any]) -> tuple[int, Any]:
        name = req["lora_name"]
        if name in self.adapters:
            return self._refusal(f"LoRA adapter {name} is already loaded", 400)
        payloads = req["serialized_named_tensors"]
        try:
            model = None
            for rank in range(self.tp):  # each tensor-parallel rank reads its own copy
                tensors = _Unpickler(io.BytesIO(base64.b64decode(payloads[rank], validate=True))).load()
                want = req.get("expected_checksums")
                if want is not None:
                    bad = [n for n in want if n not in tensors or hashlib.sha256(
                        tensors[n].detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
                    ).hexdigest() != want[n]]
                    extra = [n for n in tensors if n not in want]
                    if bad or extra:
                        raise RuntimeError(f"[LORA-CHECK] rank{rank} adapter sync MISMATCH of {len(want)} expected: "
                                           f"{bad[:5]} value-diff or missing, {extra[:5]} extra")
                model = self._strict(req["config_dict"], dict(tensors))
        except Exception as exc:
            return self._refusal(f"{type(exc).__name__}: {exc}", 400)
        assert model is not None
        self.adapters[name] = ("__tensor__", model)
        return 200, {"success": True, "error_message": "", "loaded_adapters": self._loaded()}

    def unload_lora_adapter(self, req: dict[str, Any]) -> tuple[int, Any]:
        name = req["lora_name"]
        if name not in self.adapters:
            return self._refusal(f"LoRA adapter {name} is not loaded", 400)
        del self.adapters[name]
        return 200, {"success": True, "error_message": "", "loaded_adapters": self._loaded()}

    # -- the tests' own -----------------------------------------------------------------------------
    def standin_logits(self, req: dict[str, Any]) -> tuple[int, Any]:
        model = self.adapters[req["name"]][1]
        with torch.no_grad():
            torch.save(model(**family_inputs(self.base)).logits, req["path"])
        return 200, {"success": True}

    def standin_calls(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"success": True, "calls": self.calls}


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository, for ``tests.harness.standin_http``
    from tests.harness.standin_http import main

    main(lambda: Engine().handle)
