"""One rank of a multi-node test on the namespace bed: train the JSON config in argv[1]; rank 0 saves the
per-step losses and the final full parameters to argv[2]."""

import json
import sys

import torch

from trainmesh.app.config import Config
from trainmesh.app.train import train
from trainmesh.distributed.mesh import world_env

if __name__ == "__main__":
    result = train(Config.from_settings(**json.loads(sys.argv[1])))
    state = result.run.parallel.state_dict()
    if world_env().rank == 0:
        torch.save((result.losses, state), sys.argv[2])
