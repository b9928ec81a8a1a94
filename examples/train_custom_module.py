"""Train your own ``nn.Module`` with trainmesh: no trainmesh class in the model, a plan and a layout beside it.

    trainmesh launch --nproc 4 examples/train_custom_module.py --tp 2          # dp2 x tp2
    trainmesh launch --nproc 4 examples/train_custom_module.py --pp 2 --zero 1 # dp2 x pp2, ZeRO-1

Everything trainmesh needs to know of the model is the eight lines of ``PLAN`` and ``LAYOUT``.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import trainmesh as tm


class Block(nn.Module):
    """A pre-norm residual MLP block over ``[batch, seq, hidden]``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


PLAN = {"embed": "vocab", "layers.*.norm": "sequence", "layers.*.up": "colwise", "layers.*.down": "rowwise",
        "norm": "sequence", "head": "vocab"}
LAYOUT = tm.StageLayout(blocks="layers", pre="embed", post=("norm", "head"), hidden_size=64)


def batch(step: int, size: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive token ids from random starts: the next token is learnable from the current one."""
    starts = torch.randint(0, vocab, (size, 1), generator=torch.Generator().manual_seed(step))
    tokens = (starts + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    mesh = tm.init_mesh(tp=args.tp, pp=args.pp)
    model = tm.parallelize(TokenMLP(), mesh, tp_plan=PLAN, pipeline=LAYOUT if args.pp > 1 else None,
                           zero=args.zero, recompute=(Block,), microbatches=2)
    opt = tm.optimizer(model, lr=3e-3)
    for step in range(args.steps):
        loss = tm.train_step(model, opt, batch(step, 8, 32, 256), max_norm=1.0)
        if mesh.global_rank() == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
