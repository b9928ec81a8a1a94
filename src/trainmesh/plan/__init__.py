"""Predict, before launching, whether a layout fits in memory and how long one step takes; pick the best.

Every estimate is a plain function of (model shape, workload, layout, cluster), checked against
measurements. Sources cited by the formulas:

* [ZeRO]  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020.
* [KOR]   Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022.
* [NAR]   Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
          Megatron-LM", 2021; "app. FLOPs" is its appendix deriving F = 96Bslh^2(1 + s/6h + V/16lh).
* [ZB]    Qi et al., "Zero Bubble Pipeline Parallelism", 2023.
* [THA]   Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH", 2005.
* [PALM]  Chowdhery et al., "PaLM", 2022, appendix B (model FLOPs utilization).
* [MiCS]  Zhang et al., "MiCS: Near-linear Scaling for Training Gigantic Model on Public Cloud", VLDB 2022.
* [DSV3]  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, 2024 (DualPipe, FP8 training).

Conventions shared with the runtime: ranks ordered tp fastest, then dp, then pp; a ZeRO unit is one
top-level piece of the GPT, padded to a multiple of dp; stage 0 holds the embedding, the last ``ln_f`` and
the head. Entry points are in :mod:`.ranking`; ``trainmesh plan`` is wired in :mod:`trainmesh.app.planning`."""

from __future__ import annotations

from trainmesh.distributed.hardware import (CLUSTER_PRESETS, Cluster, DEVICE_PEAKS, DevicePeak, GIB, GPU_EFFICIENCY, device_peak,
                                local_cluster, make_cluster)
from trainmesh.plan.presets import (MODEL_PRESETS, PLANNING_SHAPES, model_shape)
from trainmesh.layout import Layout
from trainmesh.plan.workload import (Pricing, Workload, check_layout, micro_batch_size)
from trainmesh.plan.memory import (MemoryBreakdown, STEP_SCALAR_BYTES, activation_bytes, active_params,
                                   cp_attention_output, in_flight_chunks, layer_activation_bytes, memory_per_rank,
                                   micro_batch_activation_bytes, model_state_bytes, params_per_tp_rank)
from trainmesh.plan.dp_traffic import DpTraffic, all_reduce_time, dp_traffic
from trainmesh.plan.timing import (TimeBreakdown, all_to_all_bytes_per_micro, block_gemms, bubble_fraction,
                                   cp_bytes_per_micro, step_flops, step_time)
from trainmesh.plan.ranking import (Estimate, TIE_TOLERANCE, best_layout, choose, cp_degrees, enumerate_layouts,
                                    estimate, runner_up, search)
from trainmesh.plan.table import (format_table, scaled, to_json)

__all__ = ["CLUSTER_PRESETS", "Cluster", "DEVICE_PEAKS", "DevicePeak", "DpTraffic", "Estimate", "GIB", "GPU_EFFICIENCY", "Layout",
           "MODEL_PRESETS", "MemoryBreakdown", "PLANNING_SHAPES", "Pricing", "STEP_SCALAR_BYTES", "TIE_TOLERANCE",
           "TimeBreakdown", "Workload", "activation_bytes", "active_params", "all_reduce_time",
           "all_to_all_bytes_per_micro", "best_layout", "block_gemms", "bubble_fraction", "check_layout", "choose",
           "cp_attention_output", "cp_bytes_per_micro", "cp_degrees", "device_peak", "dp_traffic", "enumerate_layouts",
           "estimate",
           "format_table", "in_flight_chunks", "layer_activation_bytes", "local_cluster", "make_cluster",
           "memory_per_rank", "micro_batch_activation_bytes", "micro_batch_size", "model_shape", "model_state_bytes",
           "params_per_tp_rank", "runner_up", "scaled", "search", "step_flops", "step_time", "to_json"]
