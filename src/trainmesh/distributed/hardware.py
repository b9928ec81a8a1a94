"""The one catalogue of devices: datasheet peak FLOP/s and the clusters the planner prices layouts on.
MFU measurement and the planner read the same :data:`DEVICE_PEAKS`; standard library only."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

@dataclass(frozen=True)
class DevicePeak:
    """Dense peak FLOP/s of one device from its vendor datasheet (SXM parts): 16-bit (bf16/fp16) tensor
    cores, plain fp32 (torch leaves TF32 matmuls off by default) and FP8 tensor cores (0: none; the
    datasheets' FP8 figures "with sparsity" are twice these)."""

    half: float
    fp32: float
    fp8: float = 0.0

    def at(self, precision: str) -> float:
        """The peak a run in ``precision`` can reach; 0 (unknown) for a precision not in the datasheet row."""
        return {"bf16": self.half, "fp16": self.half, "fp32": self.fp32, "fp8": self.fp8}.get(precision, 0.0)


# The one table of device peaks: MFU divides by it and the planner's cluster presets are built from it.
# Keys are matched as substrings of torch.cuda.get_device_name(), in this order.
DEVICE_PEAKS: dict[str, DevicePeak] = {
    "H200": DevicePeak(989e12, 67e12, 1979e12),
    "H100": DevicePeak(989e12, 67e12, 1979e12),
    "H800": DevicePeak(989e12, 67e12, 1979e12),  # H100's compute; the export part has slower links
    "A100": DevicePeak(312e12, 19.5e12),
    "L40S": DevicePeak(362e12, 91.6e12, 733e12),
    "L4": DevicePeak(121e12, 30.3e12, 242e12),
    "A10G": DevicePeak(70e12, 31.2e12),
}


def device_peak(device_name: str) -> DevicePeak | None:
    """The :data:`DEVICE_PEAKS` row of a device called ``device_name``; None if it is not in the table."""
    return next((peak for key, peak in DEVICE_PEAKS.items() if key in device_name), None)


GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    """Devices and links: one-way bytes/s per device (``inter_bw`` one NIC's), per-hop latencies, ``reserved_bytes``
    off limits; matmul and collective efficiencies; ``ranks_per_core``, ``direct_exchange`` (Gloo), ``memory_bw`` (0:
    unpriced), ``comm_overlaps_compute`` (NCCL) and ``hopper`` (measured kernel curves)."""

    gpus: int
    gpus_per_node: int
    mem_bytes: int
    peak_flops: float
    peak_flops_fp32: float
    intra_bw: float
    inter_bw: float
    intra_latency: float
    inter_latency: float
    gemm_efficiency: float
    gemm_half_dim: int
    comm_efficiency: float
    reserved_bytes: int
    ranks_per_core: float = 1.0
    has_bf16: bool = True
    peak_flops_fp8: float = 0.0
    direct_exchange: bool = False
    memory_bw: float = 0.0
    comm_overlaps_compute: bool = True
    hopper: bool = False

    def peak_at(self, precision: str) -> float:
        """Peak FLOP/s of a matmul in ``precision``: fp32's for the full precisions, FP8's for float8 linears on a
        device with FP8 tensor cores (0: none, so they could not run), the 16-bit peak otherwise."""
        if precision in ("fp32", "fp64"):
            return self.peak_flops_fp32
        return self.peak_flops_fp8 if precision == "fp8" else self.peak_flops

    def __post_init__(self) -> None:
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node}; "
                f"use a multiple of gpus_per_node"
            )

    @property
    def usable_bytes(self) -> int:
        return self.mem_bytes - self.reserved_bytes

    def link(self, span: int) -> tuple[float, float]:
        """(achieved bandwidth, latency) of a group of ``span`` consecutive ranks: NVLink inside a node, NIC beyond."""
        if span <= self.gpus_per_node:
            return self.intra_bw * self.comm_efficiency, self.intra_latency
        return self.inter_bw * self.comm_efficiency, self.inter_latency


def _gpu_node(mem_bytes: int, peak: DevicePeak, nvlink: float, nic: float, hbm: float, hopper: bool = False) -> Cluster:
    """One 8-GPU node from datasheet figures (``hbm`` in bytes/s), efficiencies :data:`GPU_EFFICIENCY` fitted
    to [NAR, Table 1] (checked in tests/unit/test_plan.py), Hopper's large matmuls at :data:`HOPPER_GEMM_EFFICIENCY`,
    half dimension per :func:`gemm_half_dim`."""
    gemm, _, comm = GPU_EFFICIENCY
    gemm = HOPPER_GEMM_EFFICIENCY if hopper else gemm
    return Cluster(gpus=8, gpus_per_node=8, mem_bytes=mem_bytes, peak_flops=peak.half,
                   peak_flops_fp32=peak.fp32, intra_bw=nvlink, inter_bw=nic, intra_latency=2e-6,
                   inter_latency=10e-6, gemm_efficiency=gemm, gemm_half_dim=gemm_half_dim(peak, hbm),
                   comm_efficiency=comm, reserved_bytes=2 * GIB, peak_flops_fp8=peak.fp8,
                   memory_bw=hbm * STREAM_EFFICIENCY, hopper=hopper)


def gemm_half_dim(peak: DevicePeak, hbm: float) -> int:
    """The matmul dimension at which a device reaches half its large-matmul efficiency: the A100-80GB fit's
    160 scaled by the roofline ridge point (16-bit peak / memory bandwidth) [Williams et al., "Roofline",
    2009], since a thin matmul is memory-bound below it (docs/planner.md, "The model")."""
    _, reference_dim, _ = GPU_EFFICIENCY
    return round(reference_dim * (peak.half / hbm) / (DEVICE_PEAKS["A100"].half / A100_80GB_HBM))


# (gemm_efficiency, gemm_half_dim, comm_efficiency) of a GPU, the least-squares-in-the-worst-case fit to the
# ten rows of [NAR, Table 1] (1.7B to 1T parameters on up to 3072 A100-80GB): every row within 6 %. Large
# matmuls reach 77 % of the 16-bit peak (240 of 312 TFLOP/s; refitted from 72 % when the blocks' element-wise
# work came to be priced beside them, docs/planner.md "Kernel curves"); a dimension of 160 halves that, so the
# attention core's head_dim-wide matmuls (64-160) run at a third to a half of it, which is what makes small
# models slow; NCCL reaches 70 % of the link bandwidth. Other GPUs take the fit, the half dimension scaled by
# their ridge point (:func:`gemm_half_dim`).
GPU_EFFICIENCY = (0.77, 160, 0.7)
# Hopper's large-matmul efficiency, the one fitted for the generation, with attention and grouped matmuls at the
# measured curves: the worst-case fit on the four dense Hopper rows of docs/planner.md ("Kernel curves"); no value
# brings the MoE rows within their bound while the dense rows keep theirs.
HOPPER_GEMM_EFFICIENCY = 0.65
A100_80GB_HBM = 2.039e12  # bytes/s of the device the fit was made on
# The share of the datasheet's HBM bandwidth a streaming copy reaches on A100 and H100 (BabelStream's copy and
# triad kernels measure 85-90 %); gathers of whole rows of a few KiB, as token permutations are, stream alike.
STREAM_EFFICIENCY = 0.85


# Peaks from DEVICE_PEAKS, NVLink bandwidth per direction, one 200 Gb/s (A100) or 400 Gb/s
# (H100/H200/H800) NIC per GPU, HBM bandwidth from the datasheets (A100 40GB 1.555 TB/s, 80GB 2.039; H100
# and H800 SXM 3.35; H200 4.8). H800 is the H100 with NVLink cut to 400 GB/s both ways (DeepSeek-V3 report,
# arXiv 2412.19437, 3.1-3.2.2: H800 nodes of 8 GPUs, InfiniBand at 50 GB/s per GPU, NVLink measured at 160 GB/s).
# "cpu" is one core per process at 100 GFLOP/s fp32 peak, fitted to
# ``python -m trainmesh_bench.plan --model small`` on a 2-core host: matmuls of a few hundred rows reach
# 65 % of it, and Gloo's collectives between processes move 0.37 GB/s with 2.7 ms per ring step (its threads
# hand work over on the cores the ranks compute on); across hosts no better than that. One core copies
# 20 GB/s there (a 256 MiB ``Tensor.copy_``, counting read and write).
CLUSTER_PRESETS: dict[str, Cluster] = {
    "a100-40gb": _gpu_node(40 * GIB, DEVICE_PEAKS["A100"], 300e9, 25e9, 1.555e12),
    "a100-80gb": _gpu_node(80 * GIB, DEVICE_PEAKS["A100"], 300e9, 25e9, A100_80GB_HBM),
    "h100-80gb": _gpu_node(80 * GIB, DEVICE_PEAKS["H100"], 450e9, 50e9, 3.35e12, hopper=True),
    "h200-141gb": _gpu_node(141 * 10**9, DEVICE_PEAKS["H200"], 450e9, 50e9, 4.8e12, hopper=True),
    "h800-80gb": _gpu_node(80 * GIB, DEVICE_PEAKS["H800"], 200e9, 50e9, 3.35e12, hopper=True),
    "cpu": Cluster(gpus=8, gpus_per_node=8, mem_bytes=16 * GIB, peak_flops=1e11, peak_flops_fp32=1e11,
                   intra_bw=0.37e9, inter_bw=0.37e9, intra_latency=2.7e-3, inter_latency=2.7e-3,
                   gemm_efficiency=0.65, gemm_half_dim=32, comm_efficiency=1.0, reserved_bytes=GIB,
                   has_bf16=False, direct_exchange=True, memory_bw=20e9, comm_overlaps_compute=False),
}


def make_cluster(gpu: str, gpus: int, gpus_per_node: int | None = None, *, mem_gb: float | None = None,
                 peak_tflops: float | None = None, intra_gbps: float | None = None,
                 inter_gbps: float | None = None) -> Cluster:
    """A preset resized to ``gpus`` devices, with any explicit figure (GiB, TFLOP/s, GB/s) overriding it."""
    try:
        base = CLUSTER_PRESETS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu preset {gpu!r}; choose one of {', '.join(CLUSTER_PRESETS)}") from None
    per_node = gpus_per_node or min(gpus, base.gpus_per_node)
    overrides = {"mem_bytes": None if mem_gb is None else int(mem_gb * GIB),
                 "peak_flops": None if peak_tflops is None else peak_tflops * 1e12,
                 "intra_bw": None if intra_gbps is None else intra_gbps * 1e9,
                 "inter_bw": None if inter_gbps is None else inter_gbps * 1e9}
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base, gpus=gpus, gpus_per_node=per_node, **given)


# torch.cuda.get_device_name() substrings -> cluster presets; an unknown GPU is planned as an A100 with its
# own memory size.
GPU_NAMES = {"H200": "h200-141gb", "H100": "h100-80gb", "H800": "h800-80gb", "A100": "a100-80gb"}


def local_cluster(world: int, gpu_name: str | None = None, gpu_mem_bytes: int | None = None) -> Cluster:
    """The devices ``world`` local ranks run on: one GPU each when ``gpu_name`` is given, else CPU processes sharing
    this host's physical memory and cores (``ranks_per_core``; the ``cpu`` preset's figures otherwise)."""
    if gpu_name is None:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cpu = make_cluster("cpu", world, mem_gb=host / world / GIB)
        return dataclasses.replace(cpu, ranks_per_core=max(1.0, world / (os.cpu_count() or 1)))
    preset = next((p for key, p in GPU_NAMES.items() if key in gpu_name), "a100-80gb")
    if preset == "a100-80gb" and gpu_mem_bytes is not None and gpu_mem_bytes < 60 * GIB:
        preset = "a100-40gb" if "A100" in gpu_name else preset
    mem_gb = None if gpu_mem_bytes is None else gpu_mem_bytes / GIB
    return make_cluster(preset, world, mem_gb=mem_gb)
