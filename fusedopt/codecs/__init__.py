"""State formats (codecs): how each moment of the optimizer state is stored.

One file per format (``fp32.py``, ``bf16.py``, ``blockwise.py``, ``rootgrid.py``, ``normalised.py``), each
implementing ``MomentCodec`` (``base.py``). This module is the registry above them: formats by
checkpoint name, ``state_bits`` -> format, the state format that pairs a codec for the first moment
with another for the second (``PAIRED_FORMATS``), the names of removed formats (``REMOVED_FORMATS``,
refused with a message saying so), and ``codec_for``, which picks the codec of one moment. A new
format is one file plus ``register_codec(name, factory)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .base import NO_MOMENT, BitsFn, KernelFormat, MomentCodec, decode_moments, encode_moments
from .bf16 import BF16
from .blockwise import FORMATS as BLOCK_FORMATS
from .blockwise import block_codec
from .fp32 import FP32
from .normalised import FORMATS as NORMALISED_FORMATS
from .normalised import normalised_codec
from .rootgrid import FORMATS as ROOT_GRID_FORMATS
from .rootgrid import root_grid_codec

__all__ = [
    "BF16",
    "FP32",
    "NO_MOMENT",
    "BitsFn",
    "KernelFormat",
    "MomentCodec",
    "REMOVED_FORMATS",
    "STATE_BITS_FORMATS",
    "SUPPORTED_STATE_BITS",
    "codec_for",
    "codec_named",
    "decode_moments",
    "encode_moments",
    "register_codec",
    "known_formats",
    "registered_formats",
    "removed_format_error",
]

# A factory builds a format's codec for one moment: factory(signed, shape). ``signed=False`` marks a
# moment that is never negative (an unsigned code spends its sign bit on precision).
CodecFactory = Callable[[bool, torch.Size], MomentCodec]
_REGISTRY: dict[str, CodecFactory] = {}
_INTERNAL: set[str] = set()  # formats an algorithm uses for its own statistics, not state_format values


# Formats earlier versions of fusedopt wrote (state_format values, and the per-moment names checkpoints
# record), each with why it was removed. A name here is never reused for another format.
REMOVED_FORMATS = {
    "rot8": "the rotated formats trained no better than block4 at over twice its step time",
    "rot4": "the rotated formats trained no better than block4 at over twice its step time",
    "rot2": "the rotated formats trained no better than block4 at over twice its step time",
    "rot4-log4": "it trained worse than norm2-root4, in more bytes, at twice its step time",
    "norm2-log4": "norm2-root4 keeps as few bytes and trained as well at half its step time",
    "norm4-log4": "it trained worse than the default, in more bytes than norm2-root4",
    "block8-square": "block8's minifloat levels replaced its square levels",
    "log4": "the second moment of norm2-log4, norm4-log4 and rot4-log4, removed",
    "norm4": "the first moment of norm4-log4, removed",
}


def removed_format_error(name: str, subject: str | None = None) -> ValueError | None:
    """The error for the removed format ``name`` (None: not a removed one). ``subject`` names what
    refers to it, ending where "was removed" follows (default: "the state format 'name'")."""
    why = REMOVED_FORMATS.get(name)
    if why is None:
        return None
    subject = subject or f"the state format {name!r}"
    return ValueError(
        f"{subject} was removed from fusedopt ({why}); the state formats now are "
        f"{', '.join(registered_formats())}. A checkpoint in it loads only with an older fusedopt that has "
        "it: load it there into an optimizer with one of these formats (which converts the state) and save it again."
    )


def register_codec(name: str, factory: CodecFactory, *, selectable: bool = True) -> None:
    """Make the format ``name`` available to checkpoint loading and (``selectable``) to
    ``state_format=name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a codec name must be a non-empty string, got {name!r}")
    if name in REMOVED_FORMATS:
        raise ValueError(f"the state format name {name!r} belonged to a removed format and is not reused")
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"a state format named {name!r} is registered already")
    _REGISTRY[name] = factory
    if not selectable:
        _INTERNAL.add(name)
    codec_named.cache_clear()


def known_formats() -> tuple[str, ...]:
    """Every registered name (what a checkpoint may record)."""
    return tuple(_REGISTRY)


def registered_formats() -> tuple[str, ...]:
    """The names ``state_format`` accepts."""
    return tuple(name for name in _REGISTRY if name not in _INTERNAL)


@functools.lru_cache(maxsize=4096)
def codec_named(name: str, signed: bool, shape: torch.Size) -> MomentCodec:
    """The codec of format ``name`` for one moment of ``shape``."""
    factory = _REGISTRY.get(name)
    if factory is None:
        removed = removed_format_error(name)
        if removed is not None:
            raise removed
        raise ValueError(f"unknown state format {name!r} (registered: {', '.join(_REGISTRY)})")
    return factory(signed, torch.Size(shape))


register_codec("fp32", lambda signed, shape: FP32)
register_codec("bf16", lambda signed, shape: BF16)
for _name in BLOCK_FORMATS:
    register_codec(_name, functools.partial(block_codec, _name))
# Codecs of one kind of moment only (root4: nonnegative; norm2: signed, framed): checkpoints name
# them per moment; users select them through the paired format below.
for _name in ROOT_GRID_FORMATS:
    register_codec(_name, functools.partial(root_grid_codec, _name), selectable=False)
for _name in NORMALISED_FORMATS:
    register_codec(_name, functools.partial(normalised_codec, _name), selectable=False)

# Paired formats: name -> (the codec of signed moments, that of nonnegative ones). norm2-root4 keeps
# 0.8125 bytes per parameter for AdamW's two moments.
PAIRED_FORMATS = {"norm2-root4": ("norm2", "root4")}


def _paired(signed_name: str, unsigned_name: str, signed: bool, shape: torch.Size) -> MomentCodec:
    return codec_named(signed_name if signed else unsigned_name, signed, shape)


for _name, (_signed, _unsigned) in PAIRED_FORMATS.items():
    register_codec(_name, functools.partial(_paired, _signed, _unsigned))

# state_bits -> the format it selects (for compressible tensors)
STATE_BITS_FORMATS = {32: "fp32", 16: "bf16", 8: "block8", 4: "block4"}
SUPPORTED_STATE_BITS = tuple(STATE_BITS_FORMATS)


@functools.lru_cache(maxsize=4096)
def codec_for(
    state_bits: int, shape: torch.Size, min_compress_numel: int, *, signed: bool = True, state_format: str | None = None
) -> MomentCodec:
    """The codec of a moment of a parameter with ``shape`` under a group's settings.

    Small tensors and 1-D tensors (norms, biases) keep exact fp32 moments: they are a negligible
    share of memory and the most sensitive to quantisation. Otherwise ``state_format`` names the
    format, or (None) ``state_bits`` selects one. ``signed=False`` marks a moment that is never
    negative (AdamW's second moment).
    """
    if len(shape) < 2 or shape.numel() < min_compress_numel:
        return FP32
    if state_format is None:
        if state_bits not in STATE_BITS_FORMATS:
            raise ValueError(f"Invalid state_bits: {state_bits!r} (expected 32, 16, 8 or 4)")
        state_format = STATE_BITS_FORMATS[state_bits]
    return codec_named(state_format, signed, torch.Size(shape))
