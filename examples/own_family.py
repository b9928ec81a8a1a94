"""Add a model family of your own: a config, a model in trainmesh's stage contract, and a ``ModelSpec``
registered with ``tm.register_family``. ``tm.parallelize`` then recognises the model by itself: the family's
tensor-parallel plan, its recompute targets by name and its pipeline stages need no arguments.

    trainmesh launch --nproc 2 examples/own_family.py --tp 2
    trainmesh launch --nproc 2 examples/own_family.py --pp 2
"""

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import trainmesh as tm


@dataclass(frozen=True)
class MLPConfig:
    vocab: int = 256
    d: int = 64
    n_layers: int = 4
    seq_len: int = 32

    def shape(self) -> tm.ModelShape:
        """What layout checks and the planner read: the sizes tensor parallelism must divide (this model has
        no attention, so its "heads" are the d/16 slices of 16 features each tp rank may hold)."""
        return tm.ModelShape(self.n_layers, self.d, n_heads=self.d // 16, d_ff=4 * self.d, vocab_size=self.vocab,
                             seq_len=self.seq_len, learned_positions=False)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """The stage contract: ``embed``, ``blocks`` (a ModuleDict by layer index), ``ln_f``, ``head``, each end
    possibly None on a pipeline stage; forward returns logits."""

    def __init__(self, cfg: MLPConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.blocks = nn.ModuleDict({str(i): Block(cfg.d) for i in range(cfg.n_layers)})
        self.ln_f, self.head = nn.LayerNorm(cfg.d), nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in (self.embed, *self.blocks.values(), self.ln_f, self.head):
            x = x if part is None else part(x)
        return x


FAMILY = tm.register_family(tm.ModelSpec(
    family="token-mlp",
    presets={"token-mlp-tiny": MLPConfig()},
    builder=TokenMLP,
    tp_plan={"embed": "vocab", "blocks.*.norm": "sequence", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
             "ln_f": "sequence", "head": "vocab"},
    recompute={"full": (Block,)},
    shape=MLPConfig.shape,
    accepts=lambda model: isinstance(model, TokenMLP),
))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    mesh = tm.init_mesh(tp=args.tp, pp=args.pp)
    model = tm.parallelize(TokenMLP(MLPConfig(), seed=0), mesh, sequence_parallel=args.tp > 1, recompute="full",
                           microbatches=2)
    opt = tm.optimizer(model, lr=3e-3)
    for step in range(1, args.steps + 1):
        tokens = (torch.randint(0, 256, (8, 1), generator=torch.Generator().manual_seed(step)) + torch.arange(33)) % 256
        loss = tm.train_step(model, opt, (tokens[:, :-1], tokens[:, 1:]), max_norm=1.0)
        if mesh.global_rank() == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
