# torchrun --nproc_per_node 2 quickstart.py [OUTPUT_DIR]
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import wrapkit


def build() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config)


def wrap(model):
    """The model in its wrapper, and one training step (the FSDP2 and ZeRO-3 versions are below)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return ddp, step


def main() -> None:
    dist.init_process_group("gloo")
    wrapped, train_step = wrap(build())
    policy = wrapkit.adapt(wrapped)          # the same WrappedModel API whatever the wrapper
    ref = wrapkit.prepare_reference(policy)  # a frozen copy, sharded and placed like the policy

    prompt = torch.tensor([[1, 2, 3, 4]], device=policy.device)
    with policy.generation() as m:           # eval, no autograd, full weights; modes restored on exit
        sequence = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                              do_sample=False, pad_token_id=0)

    loss = policy(sequence, labels=sequence).loss  # the training forward goes through the wrapper
    with torch.no_grad():
        ref_loss = ref(sequence, labels=sequence).loss
    train_step(loss)

    # On every rank: Hugging Face files, written once (a path every rank sees: given, or a fixed temporary one).
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "wrapkit-quickstart")
    policy.save_pretrained(out)
    with policy.generation() as m:
        logits = m(sequence).logits
    if dist.get_rank() == 0:
        print(policy.describe())
        print(f"loss {loss.item():.4f}, reference {ref_loss.item():.4f}")
        reloaded = LlamaForCausalLM.from_pretrained(out)
        torch.testing.assert_close(reloaded(sequence).logits, logits)
        print(f"reloaded from {out}: same logits")
    wrapkit.shutdown()  # on every rank, last: ends the group and the process cleanly


if __name__ == "__main__":
    main()
