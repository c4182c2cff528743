"""fusedopt.chunked_cross_entropy: the cross-entropy of an LM head's logits, a chunk of tokens at a time.

It must equal ``F.cross_entropy((hidden @ W.T).float(), labels, ignore_index=...)`` in value and in both
gradients (random inputs, sizes that chunks do not divide, every parameter dtype; on the GPU where there
is one), never hold a ``[tokens, vocab]`` tensor, hold the loss-head bytes the planner assumes (CPU
allocator), and work under gradient release.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import DTYPES
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fusedopt
from fusedopt.losses import default_chunk_size
from fusedopt.profile.memory import cpu_allocator_trace
from fusedopt.profile.models import PRESETS, TinyLM, parse_shape
from fusedopt.profile.planner import loss_head_bytes

# Tolerances against the unchunked loss. Both round each gradient once, from fp32 sums over the same
# terms in another order, so they may differ by one unit in the last place of the dtype: rtol is the
# dtype's machine epsilon (fp32: 1e-5, sums over hundreds of terms), atol that relative to the largest
# element. The loss is an fp32 sum of per-token fp32 terms in every dtype.
GRAD_RTOL = {
    torch.float32: 1e-5,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
}
LOSS_RTOL = 1e-5


def _inputs(tokens: int, vocab: int, size: int, dtype: torch.dtype, seed: int, ignored: float = 0.2, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, size, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, size, generator=gen) * size**-0.5 * 3).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < ignored] = -100
    return hidden, weight, labels.to(device)


def _loss_and_grads(fn, hidden, weight):
    hidden.grad = weight.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def _reference(hidden, weight, labels, **kwargs):
    return _loss_and_grads(lambda: F.cross_entropy((hidden @ weight.T).float(), labels, **kwargs), hidden, weight)


def _assert_grad_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol = GRAD_RTOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


# --- the value and the gradients -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 50, 203, 1000])  # one token; 4 chunks and a remainder; one chunk; larger
def test_equals_the_cross_entropy_of_the_full_logits(dtype, reduction, chunk, device):
    hidden, weight, labels = _inputs(203, 517, 37, dtype, seed=chunk, device=device)
    assert (labels == -100).any() and (labels != -100).any()
    expected = _reference(hidden, weight, labels, reduction=reduction)
    fn = lambda: fusedopt.chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk, reduction=reduction)
    loss, grad_hidden, grad_weight = _loss_and_grads(fn, hidden, weight)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected[0], rtol=LOSS_RTOL, atol=0)
    _assert_grad_close(grad_hidden, expected[1], dtype)
    _assert_grad_close(grad_weight, expected[2], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_batched_shifted_inputs_and_another_ignore_index(dtype, device):
    """[batch, seq, hidden] with the next-token shift (a non-contiguous view), chunk 10, ignore_index=-1."""
    gen = torch.Generator().manual_seed(7)
    states = torch.randn(3, 29, 24, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(301, 24, generator=gen) * 0.4).to(device, dtype).requires_grad_()
    labels = torch.randint(0, 301, (3, 29), generator=gen)
    labels[0, :5] = -1
    labels[2, -3:] = -1
    labels = labels.to(device)

    def chunked():
        return fusedopt.chunked_cross_entropy(states[:, :-1], weight, labels[:, 1:], chunk_size=10, ignore_index=-1)

    def full():
        logits = states[:, :-1] @ weight.T
        return F.cross_entropy(logits.reshape(-1, 301).float(), labels[:, 1:].reshape(-1), ignore_index=-1)

    expected = _loss_and_grads(full, states, weight)
    actual = _loss_and_grads(chunked, states, weight)
    torch.testing.assert_close(actual[0], expected[0], rtol=LOSS_RTOL, atol=0)
    _assert_grad_close(actual[1], expected[1], dtype)
    _assert_grad_close(actual[2], expected[2], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_label_ignored_gives_what_torch_gives(dtype, device):
    """Mean over no target is 0/0: nan, as torch returns, with zero gradients; the sum is 0."""
    hidden, weight, labels = _inputs(33, 65, 9, dtype, seed=3, ignored=1.0, device=device)
    assert (labels == -100).all()
    for reduction in ("mean", "sum"):
        expected = _reference(hidden, weight, labels, reduction=reduction)
        fn = lambda r=reduction: fusedopt.chunked_cross_entropy(hidden, weight, labels, chunk_size=8, reduction=r)
        loss, grad_hidden, grad_weight = _loss_and_grads(fn, hidden, weight)
        torch.testing.assert_close(loss, expected[0], equal_nan=True)
        assert loss.isnan().item() == (reduction == "mean")
        assert torch.equal(grad_hidden, expected[1]) and not grad_hidden.any()
        assert torch.equal(grad_weight, expected[2]) and not grad_weight.any()


def test_under_autocast_equals_the_linear_layer_under_autocast(device):
    """fp32 inputs under bf16 autocast: the logits in bf16, as F.linear computes them there; fp32 gradients."""
    hidden, weight, labels = _inputs(97, 211, 19, torch.float32, seed=5, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = _loss_and_grads(lambda: F.cross_entropy(F.linear(hidden, weight).float(), labels), hidden, weight)
        actual = _loss_and_grads(
            lambda: fusedopt.chunked_cross_entropy(hidden, weight, labels, chunk_size=16), hidden, weight
        )
    torch.testing.assert_close(actual[0], expected[0], rtol=LOSS_RTOL, atol=0)
    _assert_grad_close(actual[1], expected[1], torch.bfloat16)
    _assert_grad_close(actual[2], expected[2], torch.bfloat16)


def test_only_the_inputs_that_need_a_gradient_get_one():
    hidden, weight, labels = _inputs(40, 77, 8, torch.float32, seed=9)
    frozen = weight.detach()
    expected = F.cross_entropy((hidden @ frozen.T).float(), labels)
    expected.backward()
    reference, hidden.grad = hidden.grad, None
    fusedopt.chunked_cross_entropy(hidden, frozen, labels, chunk_size=7).backward()
    _assert_grad_close(hidden.grad, reference, torch.float32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reduction="none"), "reduction"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(labels=torch.zeros(5, dtype=torch.long)), "labels have shape"),
        (dict(weight=torch.zeros(11, 5)), "last dimension"),
        (dict(weight=torch.zeros(11, 4, dtype=torch.float64)), "give both in one dtype"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    args = dict(hidden=torch.zeros(6, 4), weight=torch.zeros(11, 4), labels=torch.zeros(6, dtype=torch.long))
    args.update({k: kwargs.pop(k) for k in ("labels", "weight") if k in kwargs})
    with pytest.raises(ValueError, match=message):
        fusedopt.chunked_cross_entropy(args["hidden"], args["weight"], args["labels"], **kwargs)


def test_default_chunk_holds_about_2_to_the_24_logits_a_multiple_of_8_tokens():
    assert default_chunk_size(32000) == 520 and default_chunk_size(128256) == 128
    assert default_chunk_size((1 << 24) // 12) == 8 and default_chunk_size((1 << 24) // 7) == 7
    assert default_chunk_size(1 << 30) == 1


@pytest.mark.parametrize("pieces", [None, [500, 500]])
def test_the_vocabulary_slices_of_backward_are_multiples_of_8_rows(monkeypatch, pieces):
    """The slices' widths are the row lengths of the backward matmuls (an odd one sends cuBLAS to slow kernels):
    chunk x vocab / tokens = 13 x 1000 / 70 = 185 rows per slice would be one; 184 are taken, and the
    gradients stay the unchunked loss's."""
    hidden, weight, labels = _inputs(70, 1000, 16, torch.float32, seed=3)
    widths = []
    mm = torch.mm

    def recording_mm(a, b, **kwargs):
        widths.append(a.shape[0])  # probs.T @ hidden: the slice's rows
        return mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    head = weight if pieces is None else list(torch.split(weight, pieces))
    got = _loss_and_grads(lambda: fusedopt.chunked_cross_entropy(hidden, head, labels, chunk_size=13), hidden, weight)
    monkeypatch.setattr(torch, "mm", mm)
    expected = _reference(hidden, weight, labels)
    per_head = [1000] if pieces is None else pieces
    slices = [[184] * (n // 184) + [n % 184] for n in per_head]
    assert widths == [w for s in slices for w in s if w]
    torch.testing.assert_close(got[0], expected[0], rtol=LOSS_RTOL, atol=0)
    for actual, reference in zip(got[1:], expected[1:]):
        _assert_grad_close(actual, reference, torch.float32)


# --- memory: vocabulary 8000, 2048 tokens in chunks of 128 -----------------------------------------

TOKENS, VOCAB, CHUNK = 2048, 8000, 128


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns (forward and backward, in this thread)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _memory_inputs(dtype, size=8):
    hidden, weight, labels = _inputs(TOKENS, VOCAB, size, dtype, seed=11)
    return hidden, weight, labels


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_no_tensor_of_tokens_x_vocab_is_ever_allocated(dtype):
    """The largest tensor of the chunked loss's forward and backward holds at most chunk x vocab elements;
    the unchunked loss's holds tokens x vocab (the mode sees it)."""
    hidden, weight, labels = _memory_inputs(dtype)
    mode = LargestTensor()
    with mode:
        fusedopt.chunked_cross_entropy(hidden, weight, labels, chunk_size=CHUNK).backward()
    assert hidden.grad is not None and weight.grad is not None
    assert mode.largest <= CHUNK * VOCAB, mode.largest
    if dtype == torch.float32:  # the unchunked loss, once: the mode sees its logits
        plain = LargestTensor()
        with plain:
            F.cross_entropy((hidden @ weight.T).float(), labels).backward()
        assert plain.largest >= TOKENS * VOCAB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_peak_of_the_loss_step_is_what_the_planner_assumes(dtype):
    """The CPU allocator's peak over forward and backward (it sees the scratch inside ops too):
    the unchunked loss holds 12 bytes per logit, the chunked one 8 per logit of one chunk, as
    ``planner.loss_head_bytes`` says, beyond the two input gradients and per-token vectors."""
    hidden, weight, labels = _memory_inputs(dtype)
    size = hidden.element_size()
    beyond = (hidden.numel() + weight.numel()) * size + 64 * TOKENS  # input gradients, per-token vectors

    def peak(fn):
        hidden.grad = weight.grad = None

        def step(phase):
            with phase("forward"):
                loss = fn()
            with phase("backward"):
                loss.backward()

        return cpu_allocator_trace(step)["peak"]

    chunked = peak(lambda: fusedopt.chunked_cross_entropy(hidden, weight, labels, chunk_size=CHUNK))
    plain = peak(lambda: F.cross_entropy((hidden @ weight.T).float(), labels))
    print(f"{dtype}: peak of the loss step, unchunked {plain / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB")
    assert loss_head_bytes(VOCAB, TOKENS) <= plain <= loss_head_bytes(VOCAB, TOKENS) + beyond
    assert chunked <= loss_head_bytes(VOCAB, TOKENS, CHUNK) + beyond
    assert chunked * 20 < plain


# --- gradient release and the embedded model -----------------------------------------------------------


def _tiny(chunked_loss, tie=False, dtype=torch.float32):
    shape = parse_shape(f"layers=2,vocab=389,tie_embeddings={tie}", PRESETS["tiny"])
    torch.manual_seed(0)
    return TinyLM(shape, checkpointing=True, chunked_loss=chunked_loss, dtype=dtype)


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 389, (2, 45), generator=gen)
    labels = ids.clone()
    labels[1, :9] = -100  # a prompt whose tokens are not trained on
    return ids, labels


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_embedded_model_trains_on_the_same_loss_with_either_head(tie):
    """TinyLM with chunked_loss: the same next-token loss and parameter gradients as with the full logits."""
    full, chunked = _tiny(None, tie), _tiny(7, tie)
    assert (chunked.lm_head.weight is chunked.embed_tokens.weight) == tie
    ids, labels = _batch()
    expected, actual = full(ids, labels), chunked(ids, labels)
    torch.testing.assert_close(actual, expected, rtol=LOSS_RTOL, atol=0)
    expected.backward()
    actual.backward()
    for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
        assert q.grad is not None, name
        _assert_grad_close(q.grad, p.grad, torch.float32)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gradient_release_updates_the_head_once_per_backward(tie):
    """fused=True through the chunked loss: the LM head weight's gradient arrives once per backward, is
    applied in backward and freed; every other parameter's too."""
    model = _tiny(16, tie, dtype=torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True)
    head = model.lm_head.weight
    calls = []
    head.register_post_accumulate_grad_hook(lambda p: calls.append(1))  # after the optimizer's own hook
    for step in range(3):
        before = head.detach().clone()
        model(*_batch(step)).backward()
        assert len(calls) == step + 1  # once per backward
        assert all(p.grad is None for p in model.parameters())  # released
        assert not torch.equal(head, before)  # updated inside backward, before step()
        opt.step()
        opt.zero_grad()
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())
