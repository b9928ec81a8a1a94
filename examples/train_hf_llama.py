"""Train a Hugging Face ``transformers.LlamaForCausalLM`` with trainmesh's public API.

    trainmesh launch --nproc 4 examples/train_hf_llama.py --tp 2              # dp2 x tp2
    trainmesh launch --nproc 4 examples/train_hf_llama.py --pp 2 --zero 1     # dp2 x pp2, ZeRO-1
    torchrun --nproc-per-node 4 examples/train_hf_llama.py --tp 2             # the same under torchrun
    trainmesh launch --nproc 2 examples/train_hf_llama.py --tp 2 --out runs/llama --checkpoint-dir ckpt/llama

``--out`` writes the run directory ``trainmesh report`` reads; ``--checkpoint-dir`` a checkpoint that
``trainmesh generate``, ``trainmesh export --hf`` and ``trainmesh train --resume`` take as they take their own.

The model is a small random-init Llama (grouped-query attention: 4 heads, 2 KV heads); the data a
learnable synthetic sequence, so the loss falls within a few steps. Needs ``pip install trainmesh[hf]``.
"""

import argparse

import torch
import transformers

import trainmesh as tm


def batch(step: int, size: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank: runs of consecutive token ids from random starts."""
    starts = torch.randint(0, vocab, (size, 1), generator=torch.Generator().manual_seed(step))
    tokens = (starts + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", default="", help="run directory for metrics.jsonl and summary.json")
    parser.add_argument("--checkpoint-dir", default="", help="save a checkpoint here after the last step")
    args = parser.parse_args()

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=args.layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    torch.manual_seed(0)  # every rank builds the same weights
    mesh = tm.init_mesh(tp=args.tp, pp=args.pp)
    model = tm.parallelize(transformers.LlamaForCausalLM(config), mesh, tp_plan=tm.tp_plans.llama,
                           sequence_parallel=args.tp > 1, zero=args.zero, microbatches=args.microbatches)
    opt = tm.optimizer(model, lr=3e-3)
    with tm.RunLog(args.out, args.steps, model=model, progress=False) as log:
        for step in range(args.steps):
            inputs, targets = batch(step, 8, 32, config.vocab_size)
            loss = tm.train_step(model, opt, (inputs, targets), max_norm=1.0)
            log.log(step + 1, loss=loss, tokens=inputs.numel(), grad_norm=opt.grad_norm)
            if mesh.global_rank() == 0:
                print(f"step {step} loss {loss:.4f}", flush=True)
    if args.checkpoint_dir:
        tm.save(model, opt, args.checkpoint_dir, args.steps)


if __name__ == "__main__":
    main()
