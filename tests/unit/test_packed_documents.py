"""Packed documents: the batch's documents recovered from end-of-document tokens, positions restarting in each, a
packed batch computing (float64, 1e-9) the loss and gradients of its documents run one by one and summed, in every
family, and the cp assignment balancing the attention blocks each rank computes."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trainmesh.data import documents_from_eos
from trainmesh.models import moe, preset, spec_of
from trainmesh.models.documents import Packing, document_positions, packed
from trainmesh.parallel.context_parallel import _mask, balanced_shards, chunk_starts, chunk_work

from helpers import FP64_ATOL

EOS = 7


def test_documents_end_after_each_end_of_document_token():
    inputs = torch.tensor([[1, 2, EOS, 3, EOS, EOS, 4, 5], [EOS, 1, 1, 1, 1, 1, 1, 1]])
    documents = documents_from_eos(inputs, EOS)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


FAMILIES = ["tiny", "llama-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-moe-tiny", "mistral-tiny", "gemma3-tiny", "gpt-oss-tiny", "deepseek-v3-tiny",
            "moe-tiny"]


def _model(name: str) -> torch.nn.Module:
    cfg = preset(name)
    if getattr(cfg, "moe", None) is not None:  # dropless, so a token's route does not depend on its neighbours
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=0.0))
    model = spec_of(name).builder(cfg, 3).double()
    moe.begin_step(model, 0.0)  # the aux losses are the batch's statistics, not a document's: left out here
    return model


def _packed_batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two windows of documents of unequal lengths (one of a single token, one running past a window's length of a
    sliding window), each ended by EOS."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(8, 256, (2, seq + 1), generator=gen)
    for row, ends in enumerate(([2, 3, 17, seq - 4], [11, seq - 1])):
        x[row, ends] = EOS
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_packed_batch_is_its_documents_run_alone_and_summed(name):
    model = _model(name)
    seq = preset(name).seq_len
    x, y = _packed_batch(seq)
    documents = documents_from_eos(x, EOS)
    with packed(Packing(documents, document_positions(documents))):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    alone = torch.zeros((), dtype=torch.float64)
    for row in range(x.shape[0]):
        for d in documents[row].unique():
            span = documents[row] == d
            logits = model(x[row, span][None])
            alone = alone + F.cross_entropy(logits[0], y[row, span], reduction="sum") / x.numel()
    expected = torch.autograd.grad(alone, list(model.parameters()), allow_unused=True)
    assert abs(loss.item() - alone.item()) <= FP64_ATOL
    for g, e in zip(grads, expected):
        assert (g is None) == (e is None)
        if g is not None:
            assert (g - e).abs().max().item() <= FP64_ATOL
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert abs(plain.item() - loss.item()) > 1e-4  # documents change what is seen


def _mix(seq: int, lengths: list[int], rows: int = 1, seed: int = 0) -> torch.Tensor:
    """``rows`` windows of ``seq`` tokens cut into documents of lengths drawn from ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        sizes = []
        while sum(sizes) < seq:
            sizes.append(lengths[torch.randint(len(lengths), (1,), generator=gen).item()])
        out.append(torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[:seq])
    return torch.stack(out)


def _loads(shards, chunk: int, work: list[int]) -> list[int]:
    return [sum(work[s // chunk] for s in starts) for starts in shards]


@pytest.mark.parametrize("cp", [2, 4])
def test_the_cp_assignment_balances_counted_attention_blocks(cp):
    """Documents of 256 to 1024 tokens in windows of 4096: every chunk dealt once, ranks holding equal numbers,
    the counted blocks within 15 % of perfect balance, where the head-tail pair of one causal sequence is not."""
    seq = 4096
    for seed in range(5):
        documents = _mix(seq, [256, 384, 512, 768, 1024], rows=2, seed=seed)
        shards, chunk = balanced_shards(documents, cp)
        assert sorted(s for starts in shards for s in starts) == list(range(0, seq, chunk))
        assert len({len(starts) for starts in shards}) == 1
        work = chunk_work(documents, chunk)
        loads = _loads(shards, chunk, work)
        assert max(loads) <= 1.15 * sum(loads) / cp, loads
    one_long = torch.zeros(1, seq, dtype=torch.long)  # one document: the head-tail pair is balanced already
    shards, chunk = balanced_shards(one_long, cp)
    loads = _loads(shards, chunk, chunk_work(one_long, chunk))
    assert max(loads) == min(loads)


def test_counted_work_is_the_blocks_the_ring_computes():
    """Each chunk's counted work is the number of key chunks the ring's mask does not skip for it."""
    documents = _mix(512, [16, 48, 100, 200], rows=3, seed=4)
    chunk = 32
    computed = [sum(_mask(i, chunk, j, chunk, True, documents.device, None, documents) is not False
                    for j in range(0, 512, chunk)) for i in range(0, 512, chunk)]
    assert chunk_work(documents, chunk) == computed and min(computed) < max(computed)


def test_head_tail_is_unbalanced_where_a_long_document_comes_first():
    """One long document then many short ones: the head-tail pair leaves rank 1 most of the long document's blocks
    (5 of 7), the assignment 4."""
    seq, cp = 64, 2
    documents = torch.cat([torch.zeros(48, dtype=torch.long), torch.arange(1, 5).repeat_interleave(4)])[None]
    chunk = seq // (2 * cp)
    work = chunk_work(documents, chunk)
    head_tail = _loads([chunk_starts(seq, cp, r) for r in range(cp)], chunk, work)
    shards, chunk = balanced_shards(documents, cp, per_rank=2)
    balanced = _loads(shards, chunk, chunk_work(documents, chunk))
    assert (max(head_tail), max(balanced)) == (5, 4)


def test_train_step_refuses_documents_a_model_would_ignore():
    """A model whose attention does not read documents would attend across them: refused in one line, as are
    documents that do not match the inputs or are not in order."""
    import trainmesh as tm
    from trainmesh.distributed.mesh import Mesh

    parallel = tm.parallelize(spec_of("tiny").builder(preset("tiny"), 0), Mesh.build(1, 1, 1, torch.device("cpu")))
    opt = tm.optimizer(parallel)
    x, y = _packed_batch(preset("tiny").seq_len)
    with pytest.raises(ValueError, match="documents have shape"):
        tm.train_step(parallel, opt, (x, y, documents_from_eos(x[:, 1:], EOS)))
    with pytest.raises(ValueError, match="documents decrease along a sequence"):
        tm.train_step(parallel, opt, (x, y, documents_from_eos(x, EOS).flip(1)))
    parallel.documents = False
    with pytest.raises(ValueError, match="attention does not read packed documents, so it would attend across"):
        tm.train_step(parallel, opt, (x, y, documents_from_eos(x, EOS)))


@pytest.mark.parametrize("architecture", ["LlamaConfig", "MistralConfig"])
def test_transformers_own_llama_and_mistral_objects_read_packed_documents(architecture):
    """A transformers object through tm.parallelize: each document's logits in a packed window are those of the
    document alone (Mistral's window of 4 inside it)."""
    transformers = pytest.importorskip("transformers")
    import trainmesh as tm
    from trainmesh.distributed.mesh import Mesh

    extra = {"sliding_window": 4} if architecture == "MistralConfig" else {}
    config = getattr(transformers, architecture)(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                                 max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    parallel = tm.parallelize(model, Mesh.build(1, 1, 1, torch.device("cpu")), precision="fp64")
    x, _ = _packed_batch(32)
    documents = documents_from_eos(x, EOS)
    with torch.no_grad(), packed(Packing(documents, document_positions(documents))):
        logits = parallel(x)
    with torch.no_grad():
        for row in range(x.shape[0]):
            for d in documents[row].unique():
                span = documents[row] == d
                assert (parallel(x[row, span][None])[0] - logits[row, span]).abs().max().item() <= FP64_ATOL
        assert (parallel(x) - logits).abs().max().item() > 1e-6
