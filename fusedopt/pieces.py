"""Row pieces: a vocabulary-sized embedding or LM head stored as several parameters.

With gradient release (``fused=True``) each parameter's gradient exists whole from the moment
backward produces it until its hook has applied the update. For a large vocabulary the embedding's
and the head's gradients are the largest of the model (Llama-3-8B: 0.98 GiB each in bf16), and that
gradient sets the peak. :func:`split_rows` replaces an ``nn.Embedding`` or a bias-free
``nn.Linear`` head by a module that holds the same weight as ``pieces`` row blocks, each its own
parameter: backward produces one piece's gradient at a time (for the head, through
:func:`fusedopt.chunked_cross_entropy` given the pieces) and release frees it before the next one
is computed.

The forward pass is the original module's, bit for bit, and the gradients are the same up to the
order of fp32 sums. AdamW, SGD and Lion update each element from its own gradient and state, so the
pieces follow the algorithm of the whole weight: bit for bit with exact state, and with other random
bits where a compressed format or the bf16 weights round stochastically (the bits are drawn per
parameter). The formats' blocks lie within rows where the row length is a multiple of the block.
Adafactor's factored statistics are per matrix and become per piece.
``state_dict()`` shows the one ``weight`` of the original module (the pieces concatenated, on the CPU)
and ``load_state_dict`` accepts it, so checkpoints stay those of the unsplit model
(``save_pretrained`` included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RowPiecesEmbedding", "RowPiecesLinear", "piece_rows", "split_rows"]


def piece_rows(rows: int, pieces: int) -> list[int]:
    """The rows of each piece, as ``torch.tensor_split`` divides them: the first ``rows % pieces`` one more."""
    return [rows // pieces + (i < rows % pieces) for i in range(pieces)]


class _RowPieces(nn.Module):
    """The weight ``[rows, columns]`` as ``self.pieces``, consecutive row blocks of near-equal size."""

    def __init__(self, weight: torch.Tensor, pieces: int):
        super().__init__()
        if isinstance(pieces, bool) or not isinstance(pieces, int) or not 1 <= pieces <= weight.shape[0]:
            raise ValueError(
                f"split_rows: pieces must be an integer in 1..{weight.shape[0]} (the rows), got {pieces!r}"
            )
        with torch.no_grad():
            blocks = [block.clone() for block in weight.detach().split(piece_rows(weight.shape[0], pieces))]
        self.pieces = nn.ParameterList(nn.Parameter(b, requires_grad=weight.requires_grad) for b in blocks)
        self.offsets = [0]
        for block in blocks:
            self.offsets.append(self.offsets[-1] + block.shape[0])
        self.register_state_dict_post_hook(_whole_weight)
        self.register_load_state_dict_pre_hook(_split_weight)

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    def merged_weight(self, device=None) -> torch.Tensor:
        """The whole weight, a new tensor on ``device`` (default: the pieces'): the pieces concatenated, detached."""
        return torch.cat([p.detach().to(device) for p in self.pieces], dim=0)


def _whole_weight(module: _RowPieces, state_dict: dict, prefix: str, local_metadata) -> None:
    for i in range(len(module.pieces)):
        state_dict.pop(f"{prefix}pieces.{i}", None)
    # on the CPU: a model that just fits its GPU has no room for a second copy of the weight there
    state_dict[f"{prefix}weight"] = module.merged_weight("cpu")


def _split_weight(module: _RowPieces, state_dict: dict, prefix: str, *args) -> None:
    key = f"{prefix}weight"
    if key not in state_dict:
        return  # load_state_dict reports the missing key for the pieces
    weight = state_dict.pop(key)
    if weight.dim() != 2 or weight.shape[0] != module.rows:
        raise ValueError(
            f"{key}: expected [{module.rows}, {module.pieces[0].shape[1]}], got shape {tuple(weight.shape)}"
        )
    for i, (start, end) in enumerate(zip(module.offsets, module.offsets[1:])):
        state_dict[f"{prefix}pieces.{i}"] = weight[start:end]


class RowPiecesEmbedding(_RowPieces):
    """``nn.Embedding`` (``padding_idx`` supported) with its weight in row pieces."""

    def __init__(self, weight: torch.Tensor, pieces: int, padding_idx: int | None = None):
        super().__init__(weight, pieces)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for piece, start, end in zip(self.pieces, self.offsets, self.offsets[1:]):
            here = (ids >= start) & (ids < end)
            padding = None
            if self.padding_idx is not None and start <= self.padding_idx < end:
                padding = self.padding_idx - start
            local = torch.where(here, ids - start, torch.zeros((), dtype=ids.dtype, device=ids.device))
            rows = torch.where(here[..., None], F.embedding(local, piece, padding), 0.0)
            out = rows if out is None else out + rows  # each id lies in one piece: the others add zeros
        return out


class RowPiecesLinear(_RowPieces):
    """A bias-free ``nn.Linear`` (an LM head, ``[vocab, hidden]``) with its weight in row pieces.

    Calling it builds the full output (the logits and, in backward, their gradient), as ``nn.Linear``
    does. To keep neither, pass ``module.pieces`` to :func:`fusedopt.chunked_cross_entropy` instead.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(hidden, piece) for piece in self.pieces], dim=-1)


def split_rows(module: nn.Module, pieces: int) -> RowPiecesEmbedding | RowPiecesLinear:
    """``module`` (an ``nn.Embedding`` or a bias-free ``nn.Linear``) with its weight in ``pieces`` row
    blocks: a new module on the same device and dtype; assign it in place of the old one
    (``model.lm_head = fusedopt.split_rows(model.lm_head, 8)``). Split before building the optimizer.
    A weight shared with another module (tied embeddings) would be split apart from it: untie first."""
    if isinstance(module, nn.Embedding):
        unsupported = {
            "max_norm": module.max_norm is not None,
            "scale_grad_by_freq": module.scale_grad_by_freq,
            "sparse": module.sparse,
        }
        named = [name for name, on in unsupported.items() if on]
        if named:
            raise ValueError(f"split_rows: nn.Embedding with {', '.join(named)} is not supported")
        return RowPiecesEmbedding(module.weight, pieces, module.padding_idx)
    if isinstance(module, nn.Linear):
        if module.bias is not None:
            raise ValueError("split_rows: an nn.Linear with a bias is not supported (an LM head has none)")
        return RowPiecesLinear(module.weight, pieces)
    raise TypeError(f"split_rows: expected an nn.Embedding or nn.Linear, got {type(module).__name__}")
