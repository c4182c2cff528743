"""The codec interface: how one optimizer-state tensor (a moment) is stored.

A codec turns the fp32 moment into a dict of storage tensors and back. The keys are suffixes
appended to the slot name in the parameter's state (``""`` for a single tensor, e.g.
``state["exp_avg"]``; block codecs keep ``".codes"`` and ``".scales"``). Every codec has a
pure-PyTorch encode/decode: it is the CPU path and the oracle the Triton kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Lazily drawn uniform bits for the elements of the tensor being encoded (int64, uint32 values).
BitsFn = Callable[[], torch.Tensor]


class Family:
    """``KernelFormat.family``: how the fused kernel stores a moment. Kernels compare a family with
    ``==`` and fail to compile for one they have no branch for."""

    NONE = 0  # no moment (SGD without momentum)
    FP32 = 1
    BF16 = 2  # stochastic rounding
    BLOCK = 3  # E8M0-scaled blocks of codes (fusedopt.codecs.blockwise)
    NORMALISED = 4  # codes in units of the frame's square root (fusedopt.codecs.normalised)
    ROOT_GRID = 5  # minifloat codes of a nonnegative moment's square root (fusedopt.codecs.rootgrid)


@dataclass(frozen=True, eq=False)
class KernelFormat:
    """How the fused kernel reads and writes a moment (its compile-time switches).

    Compared and hashed by identity (``eq=False``): each codec holds one, and the launch caches key
    on it, so hashing must not walk the fields on every launch.
    """

    family: int  # a Family value
    bits: int = 0  # bits per code (BLOCK: 8 or 4; NORMALISED: 2; ROOT_GRID: 4)
    signed: bool = True
    power: int = 1  # levels q**power; negative: minifloat levels with -power mantissa bits
    qmax: int = 0
    k: int = 0
    min_exponent: int = 0
    threshold: int = 0
    top: int = 0
    block: int = 32
    clip: float = 0.0  # normalised codes: the half-range's cap in block rms, an fp32 value


NO_MOMENT = KernelFormat(Family.NONE)


class MomentCodec:
    """Interface of a state format; instances are immutable and shared.

    ``name`` is recorded in checkpoints (one name, one stored meaning: never reuse a name for
    another layout or level map). ``kernel_format`` is None where the fused kernel has no branch
    for the format: ``FUSEDOPT_BACKEND=auto`` then runs the reference, ``triton`` refuses.
    """

    name: str
    state_bits: int
    suffixes: tuple[str, ...] = ("",)  # the storage keys, appended to the slot name
    kernel_format: KernelFormat | None = None
    # True: the moment is stored in units of the square root of its *frame*, another moment of the
    # same parameter (the algorithm names it: ``FusedOptimizer.frames``, AdamW's first moment ->
    # its second). ``decode`` and ``encode`` then take the frame's decoded value as ``frame=``
    # (on encode, the frame as stored after the update); ``decode_moments`` and
    # ``encode_moments`` keep that order.
    frame: bool = False
    # True: ``bits`` gives whole 32-bit words (as moment 0, the low 16 bits cleared beside a bf16 parameter without
    # a correction), of which the codec reads the top 23 (``rng.top_uniform``); False:
    # the moment's 12-bit field of the shared word (``fusedopt.rng``'s docstring)
    whole_word: bool = False

    def zeros(self, shape: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
        """Storage for an all-zero moment."""
        raise NotImplementedError

    def decode(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Storage -> fp32 moment."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, bits: BitsFn) -> dict[str, torch.Tensor]:
        """fp32 moment -> new storage tensors (same keys, dtypes and shapes as ``zeros``)."""
        raise NotImplementedError

    def encode_decayed(
        self, x: torch.Tensor, bits: BitsFn, previous: dict[str, torch.Tensor], decay: float
    ) -> dict[str, torch.Tensor]:
        """``encode(x)`` in an update where ``x = decay * decode(previous) + increment`` (an EMA;
        ``previous``: the storage before the update, still unchanged). A format may use it to keep
        the decay exact and round only the increment; the default ignores it."""
        return self.encode(x, bits)

    def invalid(self, stored: dict[str, torch.Tensor], *, signed: bool = True) -> str | None:
        """What in ``stored`` (storage of this codec read from a checkpoint) no encode writes, or None;
        checked before a loaded state is used. ``signed=False``: the slot holds a moment that is never
        negative (``FusedOptimizer.nonnegative_slots``). Here: a plain moment (the ``""`` entry) as
        ``value_problems`` sees it, and a floating-point ``.scales`` entry (block scales) with negative or
        non-finite values; each would turn the moment, then the weights, into NaN."""
        problems = []
        plain = stored.get("")
        if isinstance(plain, torch.Tensor) and plain.is_floating_point():
            problems += value_problems(plain, signed)
        scales = stored.get(".scales")
        if isinstance(scales, torch.Tensor) and scales.is_floating_point():
            bad = int((~(torch.isfinite(scales) & (scales >= 0))).sum())
            if bad:
                problems.append(f"{bad} of its {scales.numel()} block scales are negative or not finite")
        return "; ".join(problems) or None

    def layout(self, shape: torch.Size) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """Expected dtype and shape of each storage tensor (used to validate checkpoints)."""
        return {k: (t.dtype, t.shape) for k, t in self.zeros(shape, torch.device("meta")).items()}

    def bytes_per_element(self, shape: torch.Size) -> float:
        """Stored bytes per element of a moment of ``shape`` (scales included)."""
        numel = max(1, torch.Size(shape).numel())
        return sum(dtype.itemsize * size.numel() for dtype, size in self.layout(shape).values()) / numel

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def value_problems(x: torch.Tensor, signed: bool) -> list[str]:
    """What is wrong with the values of the moment ``x`` read from a checkpoint: NaN; in a signed moment
    (a first moment, momentum) an infinite value, which only gradients near fp32's largest write and
    the next update passes on to the weights; in a nonnegative one a negative value. A nonnegative
    moment may be +inf: an fp32 or bf16 second moment overflows from a large finite gradient
    (fusedopt and torch.optim save it so), and the update of its element is then 0."""
    n = x.numel()
    wrong_sign = x.isinf() if signed else x < 0
    nan, bad = torch.stack((x.isnan().sum(), wrong_sign.sum())).tolist()
    problems = [f"{nan} of its {n} values are NaN"] if nan else []
    if bad and signed:
        problems.append(f"{bad} of its {n} values are infinite")
    elif bad:
        problems.append(f"{bad} of its {n} values are negative, in a moment that is never negative")
    return problems


def _frame_of(slot: str, codecs: dict[str, MomentCodec], frames: dict[str, str]) -> str:
    frame = frames.get(slot)
    if frame is None or frame not in codecs or codecs[frame].frame:
        raise ValueError(
            f"the state format {codecs[slot].name!r} of {slot!r} stores it relative to a second moment, "
            "which this algorithm does not keep for it"
        )
    return frame


def decode_moments(
    codecs: dict[str, MomentCodec], stored: dict[str, dict[str, torch.Tensor]], frames: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Slot -> fp32 moment of every slot of one parameter (``stored``: slot -> its storage); a framed
    moment is decoded with its frame's decoded value."""
    out = {slot: codec.decode(stored[slot]) for slot, codec in codecs.items() if not codec.frame}
    for slot, codec in codecs.items():
        if codec.frame:
            out[slot] = codec.decode(stored[slot], frame=out[_frame_of(slot, codecs, frames)])
    return {slot: out[slot] for slot in codecs}


def check_draws(codecs: dict[str, MomentCodec]) -> None:
    """Refuse codecs whose draws would overlap: a first moment reading the shared word whole (its top 23 bits)
    beside a second moment reading its 12-bit field of the same word; a third moment drawing a whole word."""
    whole = [codec.whole_word for codec in codecs.values()]
    if len(whole) > 1 and whole[0] and not whole[1]:
        raise ValueError(
            f"moment codecs {list(codecs.values())}: the first draws a whole word, so the second must too (its "
            "12-bit field lies in the first one's bits)"
        )
    if any(whole[2:]):
        raise ValueError(f"moment codecs {list(codecs.values())}: only the first two moments may draw whole words")


def first_draws_whole(codecs: dict[str, MomentCodec]) -> bool:
    """Whether the first moment draws a whole word (``rng.param_draw_bits``: beside it a bf16 parameter without
    a correction takes the shared word's low 16 bits)."""
    return bool(codecs) and next(iter(codecs.values())).whole_word


def encode_moments(
    codecs: dict[str, MomentCodec],
    values: dict[str, torch.Tensor],
    draws: Callable[[int], BitsFn],
    frames: dict[str, str],
    previous: dict[str, dict[str, torch.Tensor]] | None = None,
    decays: dict[str, float] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Slot -> new storage of every slot (``draws(i, whole)``: the bits of the i-th slot, whole words or its
    12-bit field as its codec's ``whole_word`` says). With ``previous`` (the storage before the update), slots
    in ``decays`` go through ``encode_decayed``. A framed moment is encoded after its frame, in units of the
    frame as now stored."""
    check_draws(codecs)
    decays = decays or {}
    out = {}
    for i, (slot, codec) in enumerate(codecs.items()):
        if codec.frame:
            continue
        if previous is not None and slot in decays:
            out[slot] = codec.encode_decayed(values[slot], draws(i, codec.whole_word), previous[slot], decays[slot])
        else:
            out[slot] = codec.encode(values[slot], draws(i, codec.whole_word))
    for i, (slot, codec) in enumerate(codecs.items()):
        if codec.frame:
            frame = _frame_of(slot, codecs, frames)
            bits = draws(i, codec.whole_word)
            out[slot] = codec.encode(values[slot], bits, frame=codecs[frame].decode(out[frame]))
    return {slot: out[slot] for slot in codecs}
