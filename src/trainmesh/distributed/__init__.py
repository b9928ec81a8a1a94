"""The ranks of a job and how they talk: mesh, counted collectives, shared-memory transport, hardware
catalogue, local launcher and elastic agent, rank agreement, multi-node test bed and the N-rank harness."""
