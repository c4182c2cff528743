"""Cross-entropy of a language-model head without the full logits: :func:`chunked_cross_entropy`.

``chunked_cross_entropy(hidden, lm_head_weight, labels)`` is
``F.cross_entropy((hidden @ lm_head_weight.T).float(), labels, ignore_index=-100)``: the logits are
computed in the inputs' dtype, as ``nn.Linear`` computes them, and the cross-entropy in fp32. It
never builds the ``[tokens, vocab]`` logits. The forward pass runs the head's matmul and the
cross-entropy one chunk of ``chunk_size`` tokens at a time and keeps one fp32 log-sum-exp per
token. The backward pass recomputes the logits twice: by chunks of tokens for the gradient of
``hidden`` (each chunk's rows of it are one matmul over the whole vocabulary), and by slices of the
vocabulary holding as many elements for the gradient of the weight (each slice's rows of it are one
matmul over every token). Each gradient is therefore rounded once to its dtype, as in the
unchunked loss, and no fp32 ``[vocab, hidden]`` accumulator exists. The cost is three more
matmuls of the head's size than the unchunked loss (five instead of three); the largest
temporaries hold ``chunk_size x vocab`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

__all__ = ["chunked_cross_entropy", "default_chunk_size", "DEFAULT_CHUNK_ELEMENTS"]

# The default chunk holds at most this many logits (64 MiB in fp32): 128 tokens of a 128,256-token
# vocabulary, 520 of a 32,000-token one.
DEFAULT_CHUNK_ELEMENTS = 1 << 24
REDUCTIONS = ("mean", "sum")
# Row counts the loss chooses itself are multiples of this: a slice of the vocabulary is a row length
# (leading dimension) of a bf16 matmul, and one not a multiple of 16 bytes sends cuBLAS to slow kernels.
ROW_MULTIPLE = 8


def _aligned_rows(rows: int) -> int:
    """``rows`` down to a multiple of ``ROW_MULTIPLE`` (unchanged below it; at least 1)."""
    return max(1, rows - rows % ROW_MULTIPLE if rows >= ROW_MULTIPLE else rows)


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk when ``chunk_size`` is not given: ``DEFAULT_CHUNK_ELEMENTS // vocab``, down to a multiple
    of 8 (at least 1)."""
    return _aligned_rows(DEFAULT_CHUNK_ELEMENTS // vocab)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits' matmul: autocast's where it is on (as ``F.linear`` under autocast),
    else the inputs' own (which must agree, as for a matmul)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"chunked_cross_entropy: hidden is {hidden.dtype} and lm_head_weight is {weight.dtype}; "
            "give both in one dtype (or run under torch.autocast)"
        )
    return hidden.dtype


def _targets(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid mask, labels with the ignored ones replaced by 0 so that they can index)."""
    valid = labels != ignore_index
    return valid, torch.where(valid, labels, torch.zeros((), dtype=labels.dtype, device=labels.device))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, reduction, compute_dtype):
        tokens = hidden.shape[0]
        valid, safe = _targets(labels, ignore_index)
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for start in range(0, tokens, chunk_size):
                end = min(start + chunk_size, tokens)
                logits = (hidden[start:end].to(compute_dtype) @ w.T).float()
                chunk_lse = torch.logsumexp(logits, dim=-1)
                target = logits.gather(1, safe[start:end, None]).squeeze(1)
                del logits
                lse[start:end] = chunk_lse
                per_token = torch.where(valid[start:end], chunk_lse - target, torch.zeros((), device=hidden.device))
                total += per_token.sum()
        count = valid.sum().to(torch.float32)
        loss = total / count if reduction == "mean" else total  # mean over no target: 0/0 = nan, as torch
        ctx.save_for_backward(hidden, weight, labels, lse, count)
        ctx.options = (chunk_size, ignore_index, reduction, compute_dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        chunk_size, ignore_index, reduction, compute_dtype = ctx.options
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = grad_weight = None
        tokens, vocab = hidden.shape[0], weight.shape[0]
        valid, safe = _targets(labels, ignore_index)
        scale = grad_loss.to(torch.float32) / count if reduction == "mean" else grad_loss.to(torch.float32)
        # the gradient of each token's logits is (softmax - one_hot(label)) * row_scale; ignored rows are 0
        row_scale = torch.where(valid, scale, torch.zeros((), device=hidden.device))
        minus_valid = -valid.to(torch.float32)
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            if need_hidden:
                grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                for start in range(0, tokens, chunk_size):
                    end = min(start + chunk_size, tokens)
                    probs = (h[start:end] @ w.T).float()
                    probs.sub_(lse[start:end, None]).exp_()
                    probs.scatter_add_(1, safe[start:end, None], minus_valid[start:end, None])
                    probs.mul_(row_scale[start:end, None])
                    grad_hidden[start:end] = probs.to(compute_dtype) @ w
                    del probs
            if need_weight:
                # vocabulary slices of as many elements as a chunk of tokens holds
                width = _aligned_rows((chunk_size * vocab) // max(tokens, 1))
                grad_weight = torch.empty(weight.shape, dtype=compute_dtype, device=weight.device)
                for start in range(0, vocab, width):
                    end = min(start + width, vocab)
                    probs = (h @ w[start:end].T).float()
                    probs.sub_(lse[:, None]).exp_()
                    here = (safe >= start) & (safe < end)
                    index = torch.where(here, safe - start, torch.zeros((), dtype=safe.dtype, device=safe.device))
                    probs.scatter_add_(1, index[:, None], (minus_valid * here)[:, None])
                    probs.mul_(row_scale[:, None])
                    torch.mm(probs.to(compute_dtype).T, h, out=grad_weight[start:end])
                    del probs
                grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class _PieceLogSumExp(torch.autograd.Function):
    """One row piece of the head: each token's log-sum-exp over the piece's logits and its target's
    logit (0 where the target lies in another piece). Its backward yields the piece's weight gradient
    by itself, so autograd accumulates it (and release applies and frees it) before the next piece's."""

    @staticmethod
    def forward(ctx, hidden, piece, local, here, chunk_elements, compute_dtype):
        tokens, rows = hidden.shape[0], piece.shape[0]
        chunk_size = max(1, chunk_elements // max(rows, 1))  # tokens whose logits in this piece fill a chunk
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        target = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = piece.to(compute_dtype)
            for start in range(0, tokens, chunk_size):
                end = min(start + chunk_size, tokens)
                logits = (hidden[start:end].to(compute_dtype) @ w.T).float()
                lse[start:end] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, local[start:end, None]).squeeze(1)
                target[start:end] = torch.where(here[start:end], picked, target[start:end])
                del logits
        ctx.save_for_backward(hidden, piece, local, here, lse)
        ctx.options = (_aligned_rows(chunk_elements // max(tokens, 1)), compute_dtype)  # rows per slice in backward
        return lse, target

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse, grad_target):
        hidden, piece, local, here, lse = ctx.saved_tensors
        width, compute_dtype = ctx.options
        h = hidden.to(compute_dtype)
        w = piece.to(compute_dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_piece = torch.empty(piece.shape, dtype=compute_dtype, device=piece.device)
        target_scale = torch.where(here, grad_target.float(), torch.zeros((), device=hidden.device))
        with torch.autocast(hidden.device.type, enabled=False):
            # d/dlogits = softmax within the piece (exp(logits - lse)) * grad_lse + one_hot(target) * grad_target
            for start in range(0, piece.shape[0], width):
                end = min(start + width, piece.shape[0])
                probs = (h @ w[start:end].T).float()
                probs.sub_(lse[:, None]).exp_().mul_(grad_lse.float()[:, None])
                inside = here & (local >= start) & (local < end)
                index = torch.where(inside, local - start, torch.zeros((), dtype=local.dtype, device=local.device))
                probs.scatter_add_(1, index[:, None], torch.where(inside, target_scale, 0.0)[:, None])
                probs = probs.to(compute_dtype)
                torch.mm(probs.T, h, out=grad_piece[start:end])
                grad_hidden += probs @ w[start:end]
                del probs
        return grad_hidden.to(hidden.dtype), grad_piece.to(piece.dtype), None, None, None, None


def _pieces_cross_entropy(hidden, pieces, labels, chunk_size, ignore_index, reduction, compute_dtype):
    """The loss over a head given as row pieces: each piece's log-sum-exp, then one over the pieces."""
    valid, safe = _targets(labels, ignore_index)
    # the pieces' gradients of hidden are summed in fp32 and rounded to hidden's dtype once, by this cast
    hidden32 = hidden.float()
    vocab = sum(piece.shape[0] for piece in pieces)
    lses, targets, start = [], [], 0
    for piece in pieces:
        end = start + piece.shape[0]
        here = (safe >= start) & (safe < end)
        local = torch.where(here, safe - start, torch.zeros((), dtype=safe.dtype, device=safe.device))
        elements = chunk_size * vocab
        lse, target = _PieceLogSumExp.apply(hidden32, piece, local, here, elements, compute_dtype)
        lses.append(lse)
        targets.append(target)
        start = end
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    target = torch.stack(targets).sum(dim=0)  # one piece holds each target; the others add zeros
    per_token = torch.where(valid, lse - target, torch.zeros((), device=hidden.device))
    total = per_token.sum()
    return total / valid.sum().to(torch.float32) if reduction == "mean" else total


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor | Sequence[torch.Tensor],
    labels: torch.Tensor,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of an LM head's logits, computed a chunk of tokens at a time.

    Equal to ``F.cross_entropy((hidden @ lm_head_weight.T).float(), labels, ignore_index=ignore_index,
    reduction=reduction)`` (logits in the inputs' dtype, or autocast's where it is on; cross-entropy
    in fp32) without building the ``[tokens, vocab]`` logits in forward or backward.

    ``hidden`` is ``[..., hidden_size]`` (the final norm's output) and ``labels`` its leading shape:
    the caller shifts them for next-token prediction (``hidden[:, :-1]``, ``labels[:, 1:]``).
    ``lm_head_weight`` is ``[vocab, hidden_size]`` (``model.lm_head.weight``; a head with a bias is not
    supported). ``chunk_size`` is the tokens per chunk (default :func:`default_chunk_size`: about
    ``2**24`` logits per chunk, a multiple of 8 tokens; a vocabulary of a multiple of 8 keeps every matmul's rows
    16-byte aligned). ``reduction`` is ``"mean"`` over the labels that are not
    ``ignore_index`` (a batch where every label is ignored gives ``nan``, as torch does, and zero
    gradients) or ``"sum"`` (``0`` then). Returns an fp32 scalar. Gradients flow to ``hidden`` and to
    the weight, whose gradient is produced once per backward, so gradient release
    (``fused=True``) updates the head as it does under the unchunked loss.

    ``lm_head_weight`` may also be a sequence of row pieces (``fusedopt.split_rows(head, n).pieces``),
    the weight's consecutive row blocks: the same loss, with each piece's gradient produced by
    itself in backward, so that release holds one piece's gradient at a time, not the whole head's.
    (The logits are then computed twice in all instead of three times; the gradient of ``hidden`` is
    the pieces' sum, each piece's rounded to the logits' dtype.)
    """
    if not isinstance(lm_head_weight, torch.Tensor):
        pieces = list(lm_head_weight)
        if not pieces or not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in pieces):
            raise ValueError(
                "chunked_cross_entropy: lm_head_weight must be a 2-D tensor or a non-empty sequence of them"
            )
        if len({p.shape[1] for p in pieces}) != 1 or len({p.dtype for p in pieces}) != 1:
            raise ValueError(
                "chunked_cross_entropy: the pieces of lm_head_weight must share their dtype and row length"
            )
        head = pieces[0]
        vocab = sum(p.shape[0] for p in pieces)
    else:
        pieces, head = None, lm_head_weight
        vocab = head.shape[0] if head.dim() == 2 else 0
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if head.dim() != 2:
        shape = tuple(head.shape)
        raise ValueError(f"chunked_cross_entropy: lm_head_weight must be [vocab, hidden_size], got {shape}")
    size = head.shape[1]
    if hidden.shape[-1] != size:
        raise ValueError(
            f"chunked_cross_entropy: hidden's last dimension is {hidden.shape[-1]}, lm_head_weight's is {size}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"chunked_cross_entropy: labels have shape {tuple(labels.shape)}, hidden's leading shape is "
            f"{tuple(hidden.shape[:-1])}"
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_size must be a positive integer, got {chunk_size!r}")
    compute_dtype = _compute_dtype(hidden, head)
    flat_labels = labels.reshape(-1).long()
    if pieces is not None:
        flat = hidden.reshape(-1, size)
        return _pieces_cross_entropy(flat, pieces, flat_labels, chunk_size, ignore_index, reduction, compute_dtype)
    return _ChunkedCrossEntropy.apply(
        hidden.reshape(-1, size), lm_head_weight, flat_labels, chunk_size, ignore_index, reduction, compute_dtype
    )
