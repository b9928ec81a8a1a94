"""Benchmarks: each parallel form beside its PyTorch peer, and the planner against runs. The core never
imports this package; the CLI's ``bench`` command does."""
