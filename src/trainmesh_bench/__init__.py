"""Benchmarks: each parallel form beside its PyTorch peer, the planner against runs, and the cp, MoE and data
measurements. An application on trainmesh's public API (:func:`trainmesh.init_mesh`,
:func:`trainmesh.parallelize`, :func:`trainmesh.optimizer`, :func:`trainmesh.train_step`), shipped beside it;
nothing in ``trainmesh`` imports it but the ``trainmesh bench`` command, lazily."""
