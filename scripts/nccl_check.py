"""NCCL smoke test for scripts/gpu_check.sh: init one rank per GPU, all-reduce 4 MB, check the sum."""

import os

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
t = torch.full((1 << 20,), float(rank + 1), device=device)
dist.all_reduce(t)
torch.cuda.synchronize(device)
expected = world * (world + 1) / 2
assert t[0].item() == expected, (t[0].item(), expected)
if rank == 0:
    print(f"NCCL ok: backend {dist.get_backend()}, world {world}, all-reduce sum {t[0].item():.0f}")
dist.destroy_process_group()
