"""Before step 1, every rank checks that it agrees with rank 0 on the config, the model and the layout: separately
launched ranks can disagree silently and hang later. Hashes of each config field, the model's structure and the world
view are all-gathered as int64 tensors (nothing pickled); a mismatch names the rank and the field."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distributed.comm import log_all_gather


class DisagreementError(RuntimeError):
    """Ranks were started with different configs, models or layouts."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def fingerprint(settings: Mapping[str, object], model: nn.Module, world_size: int, backend: str) -> dict[str, int]:
    """One hash per setting, one for the model structure and one for the world layout."""
    values = {f"config field {name!r}": _hash(repr(value)) for name, value in settings.items()}
    structure = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    values["model structure (parameter names, shapes, dtypes)"] = _hash(structure)
    values["world layout (world size, backend)"] = _hash(f"{world_size}:{backend}")
    return values


def check_agreement(settings: Mapping[str, object], model: nn.Module, device: torch.device) -> None:
    """Raise :class:`DisagreementError` on every rank if any rank's fingerprint differs from rank 0's; ``settings``
    are the values all must share (the CLI's config less each rank's local view)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names, mine = zip(*fingerprint(settings, model, dist.get_world_size(), dist.get_backend()).items())
    table = log_all_gather(torch.tensor(mine, dtype=torch.int64, device=device)).cpu()
    for rank in range(1, table.shape[0]):
        differing = [name for name, a, b in zip(names, table[0].tolist(), table[rank].tolist()) if a != b]
        if differing:
            raise DisagreementError(f"rank {rank} disagrees with rank 0 on {', '.join(differing)}; start every "
                                    f"rank with the same command line, config file and trainmesh version")
