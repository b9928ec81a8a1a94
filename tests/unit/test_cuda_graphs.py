"""CUDA graphs for the compiled step: which layouts capture, the reason the others compile without them
(printed once, by rank 0), and the refusal without --compile."""

import pytest
import torch

import trainmesh as tm
from trainmesh.training.cuda_graphs import capture_problem, compile_mode
from trainmesh.layout import Layout, LayoutError, flag, validate
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import preset, spec_of

DENSE = Layout(compile=True, cuda_graphs=True)


def test_a_dense_single_gpu_or_data_parallel_layout_captures():
    assert compile_mode(DENSE, "cuda") == ("reduce-overhead", None)
    assert compile_mode(Layout(dp=8, zero=2, compile=True, cuda_graphs=True), "cuda") == ("reduce-overhead", None)


@pytest.mark.parametrize("layout, device, moe, reason", [
    (DENSE, "cpu", False, "the ranks run on cpu"),
    (DENSE, "cuda", True, "MoE routing sends a data-dependent number of tokens"),
    (Layout(pp=2, compile=True, cuda_graphs=True), "cuda", False, "pipeline's point-to-point"),
    (Layout(dp=2, zero=3, compile=True, cuda_graphs=True), "cuda", False, "ZeRO-3 gathers and frees"),
    (Layout(tp=2, compile=True, cuda_graphs=True), "cuda", False, "tensor parallelism's collectives"),
])
def test_layouts_that_cannot_be_captured_compile_without_graphs_and_say_why(layout, device, moe, reason):
    mode, why = compile_mode(layout, device, moe)
    assert mode == "default" and reason in why and why == capture_problem(layout, device, moe)


def test_cuda_graphs_without_compile_is_refused_in_one_line():
    with pytest.raises(LayoutError, match="^--cuda-graphs captures the compiled blocks as CUDA graphs; add --compile "
                                          "or drop --cuda-graphs$"):
        validate(Layout(cuda_graphs=True), spell=flag)


def test_a_cpu_run_prints_why_it_compiles_without_graphs_once(capsys, monkeypatch):
    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, mode: modes.append(mode) or fn)
    model = spec_of("tiny").builder(preset("tiny"), 0)
    tm.parallelize(model, Mesh.build(1, 1, 1, torch.device("cpu")), compile=True, cuda_graphs=True)
    err = capsys.readouterr().err
    assert err == "trainmesh: compiling without CUDA graphs: CUDA graphs replay GPU kernels and the ranks run on cpu\n"
    assert modes == ["default"] * (len(model.blocks) + 1)  # each block and the loss
