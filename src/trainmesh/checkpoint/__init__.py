"""Sharded, reshardable checkpoints: the file format and its reading and writing (:mod:`.store`), what a
checkpoint records of its model (:mod:`.source`), loading into any layout (:mod:`.load`), export to plain
safetensors and Hugging Face (:mod:`.export`). The manifest's schema is :mod:`.manifest`."""

from trainmesh.checkpoint.export import export, export_hf
from trainmesh.checkpoint.load import load_newest, load_state
from trainmesh.checkpoint.source import describe_model, recorded_model, recorded_weights, source_name
from trainmesh.checkpoint.store import (LATEST, LOCK, MANIFEST, CheckpointDamaged, CheckpointError,
                                        CheckpointMismatch, TrainingProgress, candidates, on_every_rank,
                                        read_manifest, read_tensors, save_state, step_dir)

__all__ = ["export", "export_hf", "load_newest", "load_state", "describe_model", "recorded_model",
           "recorded_weights", "source_name", "LATEST", "LOCK", "MANIFEST", "CheckpointDamaged", "CheckpointError",
           "CheckpointMismatch", "TrainingProgress", "candidates", "on_every_rank", "read_manifest", "read_tensors",
           "save_state", "step_dir"]
