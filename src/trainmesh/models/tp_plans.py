"""Tensor-parallel plans by model family: module-name patterns -> :data:`trainmesh.parallel.tensor_parallel.STYLES`,
for ``trainmesh.parallelize(model, mesh, tp_plan=...)``. A plan for another architecture is a dict like
these; every pattern must match a module and no module may match twice."""

from trainmesh.models import GPT_PLAN
from trainmesh.models.hf_llama import PLAN as HF_LLAMA_PLAN
from trainmesh.models.llama import TP_PLAN as LLAMA_PLAN

llama: dict[str, str] = HF_LLAMA_PLAN
"""Hugging Face ``transformers.LlamaForCausalLM`` (``model.layers.*.self_attn.q_proj``, ...)."""

gpt: dict[str, str] = GPT_PLAN
"""trainmesh's built-in GPT (``trainmesh.models.gpt.GPT``)."""

trainmesh_llama: dict[str, str] = LLAMA_PLAN
"""trainmesh's built-in Llama (``trainmesh.models.llama.Llama``: fused grouped qkv and gate/up)."""

__all__ = ["llama", "gpt", "trainmesh_llama"]
