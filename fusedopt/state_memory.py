"""A parameter's optimizer state tensors of one dtype share one allocation.

PyTorch's CUDA caching allocator serves a request of 10 MiB or more from a segment rounded up
to 2 MiB, and splits the tail off for other tensors only when more than 1 MiB remains. So an
11 MiB one-byte tensor (the moment codes of a 2048 x 5632 matrix) holds a 12 MiB block: on the
1.1B Llama shape the two moments' codes and the int8 correction of the 66 MLP matrices held
a measurable share of memory that no tensor used (benchmarks/RESULTS.md). As views of one buffer,
a parameter's moment codes and block scales (all uint8) are one request and lose one tail at
most. Only tensors of the same dtype share a buffer: ``torch.save`` refuses views of one
storage with different dtypes. So the int8 (or int16) master-weight corrections of all trainable
parameters share their own buffer per device and dtype (``SharedCorrections``): one correction
per parameter lost another 1 MiB per MLP matrix (66 MiB at 1.1B; ~0.3 GiB, two layers, at the
4.6B that fit in 24 GiB).

Each view starts on a 64-byte boundary (the kernels' vector loads need 16).
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 64


def pack(entries: dict[str, tuple[torch.dtype, torch.Size, torch.Tensor | None]], device: torch.device) -> dict:
    """``name -> (dtype, shape, source)`` to ``name -> tensor``: the tensors of each dtype are views
    of one new zeroed buffer; each holds ``source`` (a tensor of that shape, a 0-d value to fill
    with, or None: zeros)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, (dtype, _, _) in entries.items():
        by_dtype.setdefault(dtype, []).append(name)
    out = {}
    for dtype, names in by_dtype.items():
        step = max(1, ALIGN_BYTES // dtype.itemsize)  # elements per alignment unit
        offsets, total = [], 0
        for name in names:
            offsets.append(total)
            total += -(-torch.Size(entries[name][1]).numel() // step) * step
        buffer = torch.zeros(total, dtype=dtype, device=device)
        for name, start in zip(names, offsets):
            _, shape, source = entries[name]
            shape = torch.Size(shape)
            view = buffer[start : start + shape.numel()].view(shape)
            if source is not None:
                view.copy_(source.expand(shape) if source.dim() == 0 else source)
            out[name] = view
    return {name: out[name] for name in entries}


def pack_tensors(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` on ``device``, the tensors of each dtype as views of one buffer."""
    return pack({name: (t.dtype, t.shape, t) for name, t in tensors.items()}, device)


class SharedCorrections:
    """The master-weight corrections of an optimizer's parameters as views of one zeroed buffer per
    device and dtype, built at the first parameter's first update for every parameter that then
    requires grad. A parameter that did not (or was added later) gets ``None`` and allocates its own.

    A checkpoint of the optimizer holds each buffer once (``torch.save`` keeps views of one storage
    together), including the zeros of parameters never updated.
    """

    def __init__(self):
        self._views: dict[torch.Tensor, torch.Tensor] | None = None

    def view(self, p: torch.Tensor, dtype: torch.dtype, shape: torch.Size, members) -> torch.Tensor | None:
        """``p``'s view (its current contents: zero it for a fresh state), or None. ``members()``
        yields ``(parameter, dtype, shape)`` for every parameter kept with a correction."""
        if self._views is None:
            self._views = {}
            by_device: dict[torch.device, dict] = {}
            for q, q_dtype, q_shape in members():
                if q.requires_grad:
                    by_device.setdefault(q.device, {})[q] = (q_dtype, q_shape, None)
            for device, entries in by_device.items():
                self._views.update(pack(entries, device))
        view = self._views.get(p)
        if view is not None and (view.dtype, view.shape, view.device) != (dtype, shape, p.device):
            del self._views[p]  # its group's master_weight_bits changed (a checkpoint): no longer held
            view = None
        return view
