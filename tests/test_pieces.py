"""fusedopt.split_rows: an embedding or LM head held as row pieces, one parameter each.

The split module must compute what the original computes (forward bit for bit; gradients equal, the
head's through chunked_cross_entropy within the unchunked loss's tolerance), produce each piece's
gradient in its own backward node followed at once by that piece's gradient accumulation (what lets
release hold one piece at a time), keep the unsplit checkpoint keys, train under release as the
unsplit model does, and refuse what it cannot split.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import DTYPES
from test_losses import _assert_grad_close

import fusedopt
from fusedopt.pieces import RowPiecesEmbedding, RowPiecesLinear, split_rows

DTYPE_IDS = lambda d: str(d).removeprefix("torch.")  # noqa: E731


def _head(vocab, size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(size, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, size, generator=gen) * size**-0.5 * 3)
    hidden = torch.randn(61, size, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (61,), generator=gen)
    labels[torch.rand(61, generator=gen) < 0.2] = -100
    return head.to(dtype), hidden, labels


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pieces, chunk", [(1, 61), (3, 7), (7, 1000)])
def test_head_pieces_give_the_loss_and_gradients_of_the_whole_head(dtype, pieces, chunk):
    head, hidden, labels = _head(517, 37, dtype, seed=pieces)
    expected = F.cross_entropy((hidden @ head.weight.T).float(), labels)
    expected.backward()
    grad_hidden, grad_weight, hidden.grad = hidden.grad, head.weight.grad, None
    split = split_rows(head, pieces)
    loss = fusedopt.chunked_cross_entropy(hidden, split.pieces, labels, chunk_size=chunk)
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    _assert_grad_close(hidden.grad, grad_hidden, dtype)
    _assert_grad_close(torch.cat([p.grad for p in split.pieces]), grad_weight, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding_pieces_look_up_and_accumulate_as_the_whole_embedding(dtype):
    gen = torch.Generator().manual_seed(3)
    embedding = torch.nn.Embedding(301, 9, padding_idx=150).to(dtype)
    ids = torch.randint(0, 301, (4, 23), generator=gen)
    ids[0, :3] = torch.tensor([0, 150, 300])  # the first row, the padding row, the last row
    ids[1, :4] = 37  # one row looked up four times
    upstream = torch.randn(4, 23, 9, generator=gen).to(dtype)
    (embedding(ids) * upstream).sum().backward()
    split = split_rows(embedding, 4)
    out = split(ids)
    assert torch.equal(out, embedding(ids))
    (out * upstream).sum().backward()
    merged = torch.cat([p.grad for p in split.pieces])
    torch.testing.assert_close(merged, embedding.weight.grad, rtol=0, atol=0)
    assert not merged[150].any()  # the padding row gets no gradient


def _backward_order(loss, pieces):
    """The backward nodes that produce each piece's gradient and the pieces' accumulations, in order."""
    index = {id(p): i for i, p in enumerate(pieces)}
    events = []
    for i, p in enumerate(pieces):
        p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("accumulate", i)))
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and type(child).__name__ == "AccumulateGrad" and id(child.variable) in index:
                piece = index[id(child.variable)]
                node.register_prehook(lambda *_, i=piece: events.append(("compute", i)))
            stack.append(child)
    loss.backward()
    return events


def test_backward_accumulates_each_piece_before_computing_the_next():
    """Release applies and frees a gradient in its accumulation hook: if the pieces' gradients were all
    computed before the first is accumulated, they would all be alive at once."""
    head, hidden, labels = _head(203, 16, torch.float32, seed=0)
    split = split_rows(head, 5)
    events = _backward_order(fusedopt.chunked_cross_entropy(hidden, split.pieces, labels, chunk_size=9), split.pieces)
    assert sorted(i for kind, i in events if kind == "compute") == list(range(5))
    assert all(events[k + 1] == ("accumulate", i) for k, (kind, i) in enumerate(events) if kind == "compute"), events

    embedding = split_rows(torch.nn.Embedding(203, 16), 4)
    ids = torch.randint(0, 203, (2, 31))
    events = _backward_order(embedding(ids).square().sum(), embedding.pieces)
    assert sorted(i for kind, i in events if kind == "compute") == list(range(4))
    assert all(events[k + 1] == ("accumulate", i) for k, (kind, i) in enumerate(events) if kind == "compute"), events


def test_a_concatenated_head_computes_all_pieces_before_accumulating():
    """The check above can fail: a head that concatenates its pieces computes every piece's gradient in
    one node (the concatenation's) before any is accumulated."""
    head, hidden, labels = _head(203, 16, torch.float32, seed=0)
    split = split_rows(head, 5)
    events = _backward_order(F.cross_entropy(F.linear(hidden, torch.cat(list(split.pieces))), labels), split.pieces)
    assert [kind for kind, _ in events[:5]] == ["compute"] * 5


def test_state_dict_keeps_the_unsplit_keys_and_loads_them():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(50, 6), "head": torch.nn.Linear(6, 50, bias=False)})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model["embed"] = split_rows(model["embed"], 3)
    model["head"] = split_rows(model["head"], 4)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in saved.items()}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    changed = {k: v + 1 for k, v in saved.items()}
    model.load_state_dict(changed)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in changed.items())
    with pytest.raises(ValueError, match=r"expected \[50, 6\]"):
        model.load_state_dict({"embed.weight": torch.zeros(49, 6), "head.weight": changed["head.weight"]})
    missing = model.load_state_dict({"head.weight": changed["head.weight"]}, strict=False).missing_keys
    assert missing == ["embed.pieces.0", "embed.pieces.1", "embed.pieces.2"]


@pytest.mark.parametrize("fused", [False, True], ids=["step", "release"])
@pytest.mark.parametrize(
    "dtype, options",
    [(torch.float32, {}), (torch.bfloat16, dict(master_weight_bits=32))],
    ids=["fp32", "bf16-master32"],
)
def test_pieces_are_updated_as_the_whole_weight(dtype, options, fused):
    """Given the same gradients, AdamW with exact state leaves the pieces of a [203, 64] weight bit for bit
    as it leaves the whole weight, through step() and through release. (Compressed formats round with
    random bits drawn per parameter, so pieces draw other bits: the same algorithm, not the same bits.)"""
    gen = torch.Generator().manual_seed(5)
    whole = torch.nn.Linear(64, 203, bias=False).to(dtype)
    split = split_rows(whole, 4)
    kwargs = dict(lr=3e-3, fused=fused, max_grad_norm=None, weight_decay=0.1, state_bits=32, **options)
    opt_whole = fusedopt.AdamW(whole.parameters(), **kwargs)
    opt_split = fusedopt.AdamW(split.parameters(), **kwargs)
    for _ in range(3):
        grad = torch.randn(203, 64, generator=gen).to(dtype)
        (whole.weight * grad).sum().backward()
        sum((p * g).sum() for p, g in zip(split.pieces, torch.tensor_split(grad, 4))).backward()
        for opt in (opt_whole, opt_split):
            opt.step()
            opt.zero_grad()
    assert torch.equal(split.merged_weight(), whole.weight.detach())
    assert not torch.equal(whole.weight, split_rows(torch.nn.Linear(64, 203, bias=False), 4).merged_weight())


@pytest.mark.parametrize(
    "module, pieces, error, message",
    [
        (torch.nn.Linear(4, 10), 2, ValueError, "bias"),
        (torch.nn.Embedding(10, 4, sparse=True), 2, ValueError, "sparse"),
        (torch.nn.Embedding(10, 4, max_norm=1.0), 2, ValueError, "max_norm"),
        (torch.nn.Embedding(10, 4), 0, ValueError, "pieces must be an integer in 1..10"),
        (torch.nn.Embedding(10, 4), 11, ValueError, "pieces must be an integer in 1..10"),
        (torch.nn.Embedding(10, 4), 2.0, ValueError, "pieces must be an integer"),
        (torch.nn.Conv1d(4, 4, 1), 2, TypeError, "expected an nn.Embedding or nn.Linear"),
    ],
)
def test_what_cannot_be_split_is_refused(module, pieces, error, message):
    with pytest.raises(error, match=message):
        split_rows(module, pieces)


def test_pieces_that_do_not_fit_together_are_refused():
    hidden, labels = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="row length"):
        fusedopt.chunked_cross_entropy(hidden, [torch.zeros(5, 4), torch.zeros(5, 3)], labels)
    with pytest.raises(ValueError, match="non-empty sequence"):
        fusedopt.chunked_cross_entropy(hidden, [], labels)


def test_split_modules_are_the_public_types():
    assert isinstance(split_rows(torch.nn.Embedding(8, 2), 2), RowPiecesEmbedding)
    assert isinstance(split_rows(torch.nn.Linear(2, 8, bias=False), 2), RowPiecesLinear)
    assert fusedopt.split_rows is split_rows
