"""vLLM's CPU build reloading weights by itself, no sender: an in-process engine (``LLM``, one worker in this
process) starts from one checkpoint and reloads another through vLLM's own layerwise reload, the bracket its
weight-transfer engines run (``initialize_layerwise_reload``, ``load_weights``, ``finalize_layerwise_reload``);
then again with the gloo backend's repair between the load and the finalize. After each reload, the engine's greedy
tokens and log-probabilities against transformers' own for the reloaded checkpoint.

``python -m tests.vllm.reload_inprocess ROOT FAMILY...`` prints one JSON line: family -> what each reload left."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu")


from tests.vllm.server import compared, greedy, tiny_dir, tiny_model  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [7, 3, 2, 8, 100]]
NEW_TOKENS = 6


def _served(llm: Any) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    answers = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, detokenize=False,
                                          ignore_eos=True),
                           use_tqdm=False)
    out = []
    for answer in answers:
        choice = answer.outputs[0]
        out.append((list(choice.token_ids), [float(d[t].logprob) for d, t in zip(choice.logprobs, choice.token_ids,
                                                                                   strict=True)]))
    return out


def _reload(directory: str, repair: bool) -> Any:
    """A function for ``LLM.collective_rpc``: reload the worker's model from ``directory``'s checkpoint."""

    def run(worker: Any) -> list[str]:
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = worker.model_runner.model
        weights = load_file(os.path.join(directory, "model.safetensors"))
        repaired: list[str] = []
        with set_current_vllm_config(worker.vllm_config):
            initialize_layerwise_reload(model)
            model.load_weights(weights.items())
            if repair:
                from wrapkit.integrations.engines.vllm_gloo import complete_tied, repack_cpu_experts

                repaired = complete_tied(model) + repack_cpu_experts(model)
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
        return repaired

    return run


def main(root: Path, families: list[str]) -> dict[str, Any]:
    from vllm import LLM

    out: dict[str, Any] = {}
    for family in families:
        first, second = tiny_dir(root, family, 0), tiny_dir(root, family, 1)
        llm = LLM(model=first, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
                  max_num_seqs=4)
        want = {first: greedy(tiny_model(family, 0).eval(), PROMPTS, NEW_TOKENS),
                second: greedy(tiny_model(family, 1).eval(), PROMPTS, NEW_TOKENS)}
        case: dict[str, Any] = {"loaded": compared(_served(llm), want[first])}
        llm.collective_rpc(_reload(second, repair=False))
        case["vllm's reload"] = compared(_served(llm), want[second])
        case["repaired"] = llm.collective_rpc(_reload(first, repair=True))[0]
        case["repaired reload"] = compared(_served(llm), want[first])
        llm.collective_rpc(_reload(second, repair=True))
        case["repaired again"] = compared(_served(llm), want[second])
        out[family] = case
        del llm
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]), sys.argv[2:])))
