"""State formats (codecs): how each moment of the optimizer state is stored.

One file per format (``fp32.py``, ``bf16.py``, ``blockwise.py``, ``rotated.py``, ``loggrid.py``,
``rootgrid.py``, ``normalised.py``), each implementing ``MomentCodec`` (``base.py``). This module is the registry
above them: formats by checkpoint name, ``state_bits`` -> format, the state formats that pair a
codec for the first moment with another for the second (``PAIRED_FORMATS``), and ``codec_for``,
which picks the codec of one moment. A new format is one file plus ``register_codec(name, factory)``.
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
from .loggrid import FORMATS as LOG_GRID_FORMATS
from .loggrid import log_grid_codec
from .normalised import FORMATS as NORMALISED_FORMATS
from .normalised import normalised_codec
from .rootgrid import FORMATS as ROOT_GRID_FORMATS
from .rootgrid import root_grid_codec
from .rotated import FORMATS as ROTATED_FORMATS
from .rotated import rotated_codec

__all__ = [
    "BF16",
    "FP32",
    "NO_MOMENT",
    "BitsFn",
    "KernelFormat",
    "MomentCodec",
    "STATE_BITS_FORMATS",
    "SUPPORTED_STATE_BITS",
    "codec_for",
    "codec_named",
    "decode_moments",
    "encode_moments",
    "register_codec",
    "known_formats",
    "registered_formats",
]

# A factory builds a format's codec for one moment: factory(signed, shape). ``signed=False`` marks a
# moment that is never negative (an unsigned code spends its sign bit on precision).
CodecFactory = Callable[[bool, torch.Size], MomentCodec]
_REGISTRY: dict[str, CodecFactory] = {}
_INTERNAL: set[str] = set()  # formats an algorithm uses for its own statistics, not state_format values


def register_codec(name: str, factory: CodecFactory, *, selectable: bool = True) -> None:
    """Make the format ``name`` available to checkpoint loading and (``selectable``) to
    ``state_format=name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a codec name must be a non-empty string, got {name!r}")
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
        raise ValueError(f"unknown state format {name!r} (registered: {', '.join(_REGISTRY)})")
    return factory(signed, torch.Size(shape))


register_codec("fp32", lambda signed, shape: FP32)
register_codec("bf16", lambda signed, shape: BF16)
for _name in BLOCK_FORMATS:
    register_codec(_name, functools.partial(block_codec, _name))
for _name in ROTATED_FORMATS:
    register_codec(_name, functools.partial(rotated_codec, _name))
# Codecs of one kind of moment only (log4: nonnegative; norm2 / norm4: signed, framed): checkpoints
# name them per moment; users select them through the paired formats below.
for _name in LOG_GRID_FORMATS:
    register_codec(_name, functools.partial(log_grid_codec, _name), selectable=False)
for _name in ROOT_GRID_FORMATS:
    register_codec(_name, functools.partial(root_grid_codec, _name), selectable=False)
for _name in NORMALISED_FORMATS:
    register_codec(_name, functools.partial(normalised_codec, _name), selectable=False)

# Paired formats: name -> (the codec of signed moments, that of nonnegative ones). Bytes per
# parameter for AdamW's two moments: norm2-root4 0.8125, norm2-log4 0.82, rot4-log4 1.05, norm4-log4 1.07.
PAIRED_FORMATS = {
    "norm2-log4": ("norm2", "log4"),
    "norm4-log4": ("norm4", "log4"),
    "rot4-log4": ("rot4", "log4"),
    "norm2-root4": ("norm2", "root4"),
}


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
