"""The registry of test cases: algorithms, state formats, master-weight settings, parameter dtypes.

Every parametrized test draws its cases from here, so a new algorithm, a new ``state_bits`` format
(``fusedopt.codecs.STATE_BITS_FORMATS``) or a new dtype reaches every test that crosses them.

* ``ALGORITHMS``: each optimizer class with constructor options that exercise its state (SGD with
  momentum, and with nesterov momentum: SGD without momentum keeps no state). ``ALGORITHM[id]``.
* ``FORMATS``: one ``StateFormat`` per ``state_bits`` value, read from the codec registry.
  ``FORMAT[bits]``, ``formats(quantized=...)``.
* ``MASTER_WEIGHT_BITS`` (24, 32, None) and ``DTYPES`` (fp32, bf16, fp16), ``LOW_DTYPES``.

The ``*_cases`` helpers give ``pytest.param`` lists with readable ids ("adamw", "sgd-nesterov",
"state8", "bf16", "master24", "no-master"); ``cross(...)`` is their product, ids joined by "-";
``config(...)`` names one hand-picked combination (a test that covers a chosen few, not the product).
A test that uses a subset selects it here by id, and says why::

    @pytest.mark.parametrize("algo,fmt,dtype", cross(algorithm_cases(), format_cases(), dtype_cases()))
    def test_x(algo, fmt, dtype):
        opt = algo.make(params, **fmt.kwargs)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import pytest
import torch

import fusedopt
from fusedopt.codecs import STATE_BITS_FORMATS, codec_named

# --- algorithms ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Algorithm:
    """One optimizer class with the constructor options a case runs it with."""

    id: str
    cls: type[fusedopt.FusedOptimizer]
    kwargs: Mapping = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "kwargs", MappingProxyType(dict(self.kwargs)))

    @property
    def slots(self) -> tuple[str, ...]:
        """The state slots these options keep for a matrix (SGD's momentum buffer only with a momentum)."""
        return self.slots_of((8, 8))

    def slots_of(self, shape) -> tuple[str, ...]:
        """The state slots these options keep for a parameter of ``shape`` (Adafactor's second moment is
        factored for two or more dimensions, element-wise below)."""
        if self.cls is fusedopt.SGD and not self.kwargs.get("momentum"):
            return ()
        if self.cls is fusedopt.Adafactor:
            p = torch.nn.Parameter(torch.empty(shape, device="meta"))
            opt = self.make([p])
            return tuple(opt.codecs(p, opt.param_groups[0]))
        return tuple(self.cls.slots)

    @property
    def elementwise(self) -> bool:
        """Whether the update is element-wise (the fused kernel of kernels/update.py runs it)."""
        return self.cls.kernel == "update"

    def options(self, **extra) -> dict:
        """The case's constructor options, ``extra`` added (and winning)."""
        return {**self.kwargs, **extra}

    def make(self, params, **extra) -> fusedopt.FusedOptimizer:
        return self.cls(params, **self.options(**extra))

    def __repr__(self) -> str:
        return self.id


ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("adamw", fusedopt.AdamW),
    Algorithm("sgd-momentum", fusedopt.SGD, {"momentum": 0.9}),
    Algorithm("sgd-nesterov", fusedopt.SGD, {"momentum": 0.9, "nesterov": True}),
    Algorithm("lion", fusedopt.Lion),
    # with a first moment: a moment in the state format under test beside the factored statistics
    Algorithm("adafactor", fusedopt.Adafactor, {"beta1": 0.9}),
)
ALGORITHM: dict[str, Algorithm] = {a.id: a for a in ALGORITHMS}
# one case per class: where a variant adds nothing a test checks (say why where it is used)
PRIMARY_ALGORITHMS: tuple[Algorithm, ...] = tuple(ALGORITHM[i] for i in ("adamw", "sgd-momentum", "lion"))
# the algorithms of the element-wise kernel (kernels/update.py), whose updates equal the reference bit for
# bit; Adafactor's kernels reduce in another order than torch: tests/test_adafactor.py holds them to it
ELEMENTWISE_ALGORITHMS: tuple[Algorithm, ...] = tuple(a for a in ALGORITHMS if a.elementwise)


# --- state formats ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateFormat:
    """A ``state_bits`` value and the registered codec it selects."""

    bits: int
    name: str

    @property
    def id(self) -> str:
        return f"state{self.bits}"

    @property
    def kwargs(self) -> dict:
        return {"state_bits": self.bits}

    @property
    def has_kernel(self) -> bool:
        """Whether the fused kernel has a branch for the format (else the reference runs it)."""
        return codec_named(self.name, True, torch.Size([64, 64])).kernel_format is not None

    @property
    def quantized(self) -> bool:
        """Stored as codes and scales (a block format), not as one float tensor per moment."""
        return codec_named(self.name, True, torch.Size([64, 64])).suffixes != ("",)

    def __repr__(self) -> str:
        return self.id


FORMATS: tuple[StateFormat, ...] = tuple(StateFormat(bits, name) for bits, name in STATE_BITS_FORMATS.items())
FORMAT: dict[int, StateFormat] = {f.bits: f for f in FORMATS}


def formats(*bits: int, quantized: bool | None = None) -> tuple[StateFormat, ...]:
    """The formats of ``bits`` (all when none given), optionally only the (un)quantized ones."""
    chosen = FORMATS if not bits else tuple(FORMAT[b] for b in bits)
    return tuple(f for f in chosen if quantized is None or f.quantized == quantized)


# --- master weights and dtypes ------------------------------------------------------------------

MASTER_WEIGHT_BITS: tuple[int | None, ...] = (24, 32, None)

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
LOW_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)  # split into head + correction
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def master_id(bits: int | None) -> str:
    return "no-master" if bits is None else f"master{bits}"


# --- pytest.param lists -------------------------------------------------------------------------


def algorithm_cases(*ids: str) -> list:
    """``pytest.param(Algorithm)`` for the given ids, or every registered algorithm."""
    chosen = ALGORITHMS if not ids else tuple(ALGORITHM[i] for i in ids)
    return [pytest.param(a, id=a.id) for a in chosen]


def format_cases(*bits: int, quantized: bool | None = None) -> list:
    """``pytest.param(StateFormat)`` for ``formats(*bits, quantized=...)``."""
    return [pytest.param(f, id=f.id) for f in formats(*bits, quantized=quantized)]


def dtype_cases(*dtypes: torch.dtype) -> list:
    """``pytest.param(dtype)`` for the given dtypes, or all of ``DTYPES``."""
    return [pytest.param(d, id=DTYPE_IDS[d]) for d in (dtypes or DTYPES)]


def master_cases(*bits: int | None) -> list:
    """``pytest.param(master_weight_bits)`` for the given settings, or all of ``MASTER_WEIGHT_BITS``."""
    return [pytest.param(b, id=master_id(b)) for b in (bits or MASTER_WEIGHT_BITS)]


def _param(case):
    if isinstance(case, type(pytest.param(None))):
        return case
    return pytest.param(case, id=case.id if hasattr(case, "id") else str(case))


def cross(*lists: Iterable) -> list:
    """The product of case lists: values concatenated, ids joined by "-", marks merged."""
    out = []
    for combo in itertools.product(*([_param(c) for c in cases] for cases in lists)):
        values = tuple(v for p in combo for v in p.values)
        marks = tuple(m for p in combo for m in p.marks)
        out.append(pytest.param(*values, id="-".join(p.id for p in combo), marks=marks))
    return out


# --- hand-picked combinations -------------------------------------------------------------------

_UNSET = object()


@dataclass(frozen=True)
class Config:
    """One chosen combination of algorithm, state format, parameter dtype and master weights."""

    algorithm: Algorithm
    format: StateFormat
    dtype: torch.dtype
    master_weight_bits: object = _UNSET  # the optimizer's default when unset
    extra: Mapping = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @property
    def cls(self) -> type[fusedopt.FusedOptimizer]:
        return self.algorithm.cls

    @property
    def kwargs(self) -> dict:
        """Constructor options: the algorithm's, ``state_bits``, master_weight_bits if set, extras."""
        kwargs = self.algorithm.options(**self.format.kwargs)
        if self.master_weight_bits is not _UNSET:
            kwargs["master_weight_bits"] = self.master_weight_bits
        return {**kwargs, **self.extra}

    def make(self, params, **extra) -> fusedopt.FusedOptimizer:
        return self.cls(params, **{**self.kwargs, **extra})

    @property
    def id(self) -> str:
        parts = [self.algorithm.id, self.format.id, DTYPE_IDS[self.dtype]]
        if self.master_weight_bits is not _UNSET:
            parts.append(master_id(self.master_weight_bits))
        parts += [f"{k}={v}" for k, v in self.extra.items()]
        return "-".join(parts)

    def __repr__(self) -> str:
        return self.id


def config(algorithm: str, state_bits: int, dtype: torch.dtype, master_weight_bits=_UNSET, **extra) -> Config:
    """``Config`` of registered cases: ``config("adamw", 8, torch.bfloat16, 24)``."""
    return Config(ALGORITHM[algorithm], FORMAT[state_bits], dtype, master_weight_bits, extra)


def config_cases(*configs: Config) -> list:
    return [pytest.param(c, id=c.id) for c in configs]
