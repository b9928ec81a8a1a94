"""The loss with loss masks is the mean over the trained tokens of the global batch, identical (1e-12, float64)
under every micro-batch split and layout, with micro-batches of unequal trained-token counts (one of none);
a mean of per-micro-batch means, the old weighting, would differ."""

import dataclasses

import torch
import torch.nn.functional as F

import trainmesh as tm
from trainmesh import api
from trainmesh.distributed.testing import run_ranks
from trainmesh.training.loss import IGNORE_INDEX, divisors, micro_loss

from helpers import Case, build, config, in_fp64

EXACT = 1e-12
STEPS = 3


def masked(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` with a prompt-like prefix of each sequence's targets not trained, of a different length in every
    sequence (sequence 5 wholly untrained), so micro-batches and cp halves hold unequal counts."""
    x, y = batch
    y = y.clone()
    seq = y.shape[1]
    for i in range(y.shape[0]):
        y[i, :seq if i == 5 else (i * 7 + 3) % seq] = IGNORE_INDEX
    return x, y


def _case(**layout) -> Case:
    return in_fp64(config(global_batch=8, **layout))


def losses_and_norms(case: Case) -> list[tuple[float, float, int]]:
    """Every rank: ``STEPS`` steps of masked batches at learning rate 0 (so every step sees the initial weights):
    each step's loss, gradient norm and trained-token count."""
    torch.set_num_threads(1)
    run = build(case)
    out = []
    for step in range(STEPS):
        run.opt.lr = 0.0
        loss = tm.train_step(run.parallel, run.opt, masked(run.batch(step)))
        out.append((loss, run.opt.grad_norm, run.opt.trained_tokens))
    return out


def direct(case: Case) -> list[tuple[float, float]]:
    """The definition, in one process without trainmesh's step: the summed token losses over the trained-token
    count of the whole batch, and its gradient's norm."""
    run = build(dataclasses.replace(case, microbatches=1))
    out = []
    for step in range(STEPS):
        x, y = masked(run.batch(step))
        run.model.zero_grad()
        logits = run.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        loss = loss / (y != IGNORE_INDEX).sum()
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.model.parameters()]))
        out.append((loss.item(), norm.item()))
    return out


def _assert_same(got: list[tuple[float, float, int]], want: list[tuple[float, float]], what: str) -> None:
    for step, ((loss, norm, _), (ref_loss, ref_norm)) in enumerate(zip(got, want, strict=True)):
        assert abs(loss - ref_loss) <= EXACT, f"{what} step {step}: loss {loss!r} vs {ref_loss!r}"
        assert abs(norm - ref_norm) <= EXACT, f"{what} step {step}: grad norm {norm!r} vs {ref_norm!r}"


def test_one_process_loss_is_the_token_mean_for_1_2_4_micro_batches():
    want = direct(_case())
    for m in (1, 2, 4):
        got = losses_and_norms(_case(microbatches=m))
        _assert_same(got, want, f"microbatches={m}")
        x, y = masked(build(_case()).batch(0))
        assert got[0][2] == int((y != IGNORE_INDEX).sum()) < y.numel()


def _two_ranks(cases: list[Case]) -> list[list[tuple[float, float, int]]]:
    return [losses_and_norms(case) for case in cases]


def test_dp2_pp2_cp2_and_vocab_parallel_tp2_give_the_same_token_mean():
    cases = [_case(dp=2, microbatches=m) for m in (1, 2, 4)]
    cases += [_case(pp=2, microbatches=2), _case(cp=2, microbatches=2), _case(tp=2, microbatches=2),
              _case(model="tiny-deep", pp=2, schedule="interleaved", virtual_stages=2, microbatches=2)]
    want = {model: direct(_case(model=model)) for model in ("tiny", "tiny-deep")}
    for case, got in zip(cases, run_ranks(_two_ranks, 2, cases, timeout=600)[0], strict=True):
        _assert_same(got, want[case.model], f"dp={case.dp} pp={case.pp} {case.schedule} cp={case.cp} tp={case.tp} "
                                            f"m={case.microbatches}")


def test_a_mean_of_micro_batch_means_would_weigh_sparse_micro_batches_up():
    """The old normalisation (each micro-batch's mean over the count of micro-batches) gives another loss once
    micro-batches hold unequal trained-token counts; the token mean does not depend on the split."""
    torch.set_num_threads(1)
    case = _case(microbatches=2)
    run = build(case)
    micro = api.rank_slice(run.mesh, masked(run.batch(0)), case.microbatches)
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in micro]
    assert counts[0] != counts[1]
    m = run.parallel
    mean_of_means = api.forward_backward(m.module, m.engine, None, micro, m.criterion).item()
    token_mean = direct(case)[0][0]
    assert abs(mean_of_means - token_mean) > 1e-3, (mean_of_means, token_mean)


def test_plain_data_divides_by_the_micro_batch_count_exactly_and_an_untrained_micro_batch_adds_zero():
    for m in (1, 2, 3, 4, 6):
        for ranks in (1, 2, 4):
            assert divisors([7] * m, 7 * m * ranks, ranks) == [m] * m  # the old mean of means, bit for bit
    logits = torch.randn(2, 3, 5, requires_grad=True)
    zero = micro_loss(F.cross_entropy, logits, torch.full((2, 3), IGNORE_INDEX), divisors([0, 6], 6, 1)[0])
    zero.backward()
    assert zero.item() == 0.0 and (logits.grad == 0).all()
