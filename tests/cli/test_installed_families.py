"""A model family from an installed package: a ``trainmesh.families`` entry point in a ``*.dist-info`` on the
path makes its presets ``--model`` names, loaded only when a name is not trainmesh's own; an entry point that
fails to load is one line naming it, and the others still train."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAMILY = '''
from trainmesh.models import llama
from trainmesh.models.spec import ModelSpec

SPEC = ModelSpec("plugin-llama", {"plugin-llama-tiny": llama.LlamaConfig(
    n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=256, seq_len=16)},
    llama.Llama, llama.TP_PLAN, {}, llama.LlamaConfig.shape, accepts=lambda model: False)
'''


def _install(site: Path, package: str, module: str, entry: str) -> None:
    """What pip leaves for a package with one module and an entry point: the module and its ``dist-info``."""
    (site / f"{package}.py").write_text(module)
    info = site / f"{package}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[trainmesh.families]\n{entry}\n")


def test_an_installed_family_trains_by_its_preset_name_and_a_broken_one_is_one_line(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "plugin_llama", FAMILY, "plugin-llama = plugin_llama:SPEC")
    _install(site, "broken_family", 'raise ImportError("needs a newer torch\\nsecond line")\n',
             "broken = broken_family:SPEC")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--model", "plugin-llama-tiny", "--nproc", "2",
                          "--dp", "2", "--steps", "1", "--global-batch", "2", "--no-progress", "--out", "run"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plugin-llama-tiny (" in out.stdout and (tmp_path / "run" / "metrics.jsonl").exists()
    said = ("trainmesh: entry point broken = broken_family:SPEC of broken_family (trainmesh.families) failed to "
            "load (ImportError: needs a newer torch); fix or uninstall that package")
    assert said in out.stderr.splitlines()
