"""Master weights: how the full-precision value of a parameter is held.

fp32 parameters are their own master. For bf16/fp16 parameters, ``master_weight_bits``
selects the scheme:

* ``None``: no correction term; each update is written to the parameter dtype with
  stochastic rounding, so updates below one ulp still land in expectation.
* ``24`` / ``32``: master-weight splitting. The parameter holds the *head*, the master rounded
  to the parameter dtype (what forward passes see), and ``state["master_correction"]`` (int8
  for 24, int16 for 32, the parameter's shape) holds ``k = 8`` / ``16`` more bits, so that
  head + correction decodes to the master.

Bit-level scheme
----------------
Everything is sign-magnitude integer arithmetic on bit patterns (int32, plus fp32 only for
the fp16 subnormal range below), elementwise, with no data-dependent control flow, so that
a Triton kernel computes the same bits.

Let ``A`` be the 31 magnitude bits of the fp32 value and ``F_k`` the *extended format*: the
parameter's float format with ``k`` more mantissa bits. ``P`` is the magnitude's code in
``F_k``; the codes are monotone and evenly spaced inside each binade, so adding 1 to ``P``
moves to the next representable value, across binade edges too.

* bf16, k = 16: ``F_16`` is fp32 itself: ``P = A``, no rounding.
* bf16, k = 8: ``F_8`` is fp32 with the low 8 mantissa bits dropped: ``P = (A + r) >> 8``.
* fp16 (bias 15 against fp32's 127): in fp16's normal range (``A >= 0x38800000``, 2**-14)
  ``N = A - 0x38000000`` re-biases the exponent and ``P = N << 3`` (k = 16: fp32's 23
  mantissa bits fit in 10 + 16, no rounding) or ``P = (N + r) >> 5`` (k = 8). Below 2**-14
  (fp16 subnormals) the extended format is fixed point: ``P = round(|x| * 2**(24 + k))``
  (the fp32 product is exact; its fraction is compared with the random draw).

``r`` is the rounding offset: the top bits of the optimizer's random draw (``rng``: the
8-bit field of the shared word for bf16 + int8, a word of its own for fp16), half a step for
nearest rounding (``load_master_state_dict``). Then

    h = (P + 2**(k-1)) >> k          head magnitude: nearest, ties away from zero
    c = P - (h << k)                 correction, always in [-2**(k-1), 2**(k-1) - 1]

and the head is ``sign | h`` in the parameter dtype. Decoding inverts it exactly:
``P = (h << k) + c``, then ``A = P << (16 - k)`` (bf16), ``A = (P >> 3) + 0x38000000`` /
``(P << 5) + 0x38000000`` (fp16 normal, k = 16 / 8) or ``|x| = P * 2**-(24 + k)`` (fp16,
``P < 2**(10 + k)``).

Why ties away from zero: a tie (low bits exactly half a head ulp) must go to one side for
the signed difference to fit; half-up in pattern space keeps ``c`` in
``[-2**(k-1), 2**(k-1) - 1]`` for every input. Round-half-to-even (torch's ``.to()``) cannot
work for any split: an even head would own 2**k + 1 values of ``F_k``, one more than ``k``
bits can tell apart. So the head differs from ``master.to(dtype)`` only on exact ties (then by one
ulp, away from zero).

Precision
---------
* bf16 + int16 (32): every finite fp32 value round-trips **bit for bit** (zeros of both
  signs, subnormals, binade edges, ties), except the top half ulp of the bf16 range (below).
  So training with ``state_bits=32, master_weight_bits=32`` on a bf16 model follows fp32
  master weights exactly; forward sees the master rounded to nearest with ties away from
  zero (bf16 autocast rounds ties to even: the only possible difference).
* bf16 + int8 (24): the master lives on ``F_8`` (16 significant bits, a relative spacing of
  2**-15 to 2**-16), 256 steps per bf16 ulp.
* fp16 + int16 (32): bit for bit for ``|x| >= 2**-17`` (about 7.6e-6: fp16's normal range
  and the top three binades of its subnormal range) up to 65520 (below); smaller values are
  fixed point with step 2**-40 (error below 1e-12).
* fp16 + int8 (24): 19 significant bits in fp16's normal range (256 steps per fp16 ulp),
  fixed point with step 2**-32 below 2**-14.

Rounding of the 24-bit master: stochastic. An update is first rounded onto the ``F_8`` grid
(256 steps per bf16 ulp, 2**-15 relative). Round-to-nearest would drop every update below
half a step (an update of 1e-6 on a weight of 1, e.g. Adam at lr 1e-6, never lands) and
bias the ones near it: a constant update of a tenth of a bf16 ulp is 25.6 steps, rounded
to 26 every time, 1.6 % too far after any number of steps. Stochastic rounding (counter
hash, ``rng``) makes the stored master equal the fp32 result in expectation
at any update size; its error is zero-mean, at most half a step per update in standard
deviation (at most sqrt(T)/2 steps after T updates: 16 steps, a sixteenth of a bf16 ulp,
after 1000), a random walk rather than a drift. The 32-bit bf16 split
never rounds (fp32 values are on its grid); the fp16 32-bit split rounds stochastically
too, below 2**-17 only.

Top of the range: a finite master whose nearest head would overflow to inf (bf16:
``|x| >= 0x7F7F8000`` as a pattern, about 3.3961776e38, the last 2**15 fp32 values below
FLT_MAX per sign; fp16: ``|x| >= 65520``) cannot be held with a finite nearest head and an
in-range correction. (For bf16, counting pairs, a bijection with fp32 exists, but the only pairs left
over are a zero head with a negative correction: the head would be nowhere near the value.)
It saturates: the head is the largest finite value (bf16 3.3895e38, fp16 65504) and the
master is clamped to the largest value below the rounding threshold (bf16: pattern
0x7F7F7FFF; fp16: the largest fp32 below 65520 at k = 16, 65520 - 2**-3 at k = 8), never
inf. Non-finite values (NaN, or an update that overflowed fp32 itself: for bf16 that is only
one bf16 ulp above its largest value) pass through as torch would store them: the head is
``x.to(dtype)``, the correction 0, and a non-finite head decodes to itself.

Checkpoints: the correction is relative to the parameter's dtype at save time (a parameter
changed between bf16 and fp16 across save/load would be misread; it is not recorded). On load
(``convert_correction``) a matching correction is copied; int8 -> int16 (24 -> 32) widens
exactly (``c << 8``); int16 -> int8 and dropping a correction (``None``, fp32 parameters) are
accepted only when lossless, else a clear error. A missing correction (a checkpoint from
fp32 parameters, a torch.optim one, or ``master_weight_bits=None``) becomes zero: the master
is then exactly the bf16/fp16 value the model holds. The optimizer state has no weights;
to restore fp32 weights losslessly, load the optimizer state first, then the fp32 weights
with ``fusedopt.load_master_state_dict`` (see ``weights.py``).
"""

from __future__ import annotations

import torch

from .rounding import LOW_PRECISION, round_stochastic

SUPPORTED_MASTER_WEIGHT_BITS = (None, 24, 32)
MASTER_CORRECTION = "master_correction"  # the state key of the correction
CORRECTION_DTYPES = {24: torch.int8, 32: torch.int16}
_EXTRA_BITS = {torch.int8: 8, torch.int16: 16}  # correction dtype -> k

# Largest finite head magnitude (pattern without the sign), per parameter dtype.
_HEAD_MAX = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}
_F32_MAG_MAX = 0x7F7FFFFF  # FLT_MAX
_F16_REBIAS = 0x38000000  # (127 - 15) << 23: fp32 exponent -> fp16 exponent
_F16_MIN_NORMAL = 0x38800000  # 2**-14 as an fp32 pattern
_F16_CLAMP = 0x47800000  # 2**16: anything above saturates anyway


def check_master_weight_bits(bits) -> None:
    """Validate a group's ``master_weight_bits`` (ignored, but still validated, for fp32 parameters)."""
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int)):
        raise ValueError(f"Invalid master_weight_bits: {bits!r} (expected 24, 32 or None)")
    if bits not in SUPPORTED_MASTER_WEIGHT_BITS:
        raise ValueError(
            f"Invalid master_weight_bits: {bits!r} (expected 24 = bf16/fp16 + int8 correction, "
            "32 = bf16/fp16 + int16 correction, or None = stochastic rounding without correction)"
        )


def is_split(param: torch.Tensor, master_weight_bits) -> bool:
    """Whether ``param`` is held as head + correction under ``master_weight_bits``."""
    return master_weight_bits is not None and param.dtype in LOW_PRECISION


def correction_layout(param: torch.Tensor, master_weight_bits) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """dtype and shape of the state entries the master scheme keeps beside the parameter."""
    if not is_split(param, master_weight_bits):
        return {}
    return {MASTER_CORRECTION: (CORRECTION_DTYPES[master_weight_bits], param.shape)}


def correction_zeros(param: torch.Tensor, master_weight_bits) -> dict[str, torch.Tensor]:
    """State entries the master scheme keeps beside the parameter (none without splitting)."""
    layout = correction_layout(param, master_weight_bits)
    return {key: torch.zeros(shape, dtype=dtype, device=param.device) for key, (dtype, shape) in layout.items()}


# --- the split: fp32 <-> (head, correction) ------------------------------------------------


def _to_int16(pattern: torch.Tensor) -> torch.Tensor:
    """int32 holding a 16-bit pattern in [0, 0xFFFF] -> int16 with the same bits."""
    return (pattern - ((pattern & 0x8000) << 1)).to(torch.int16)


def split_master(
    x: torch.Tensor, dtype: torch.dtype, correction_dtype: torch.dtype, bits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (head in ``dtype``, correction in ``correction_dtype``) (see the module docstring).

    ``bits``: uniform 32-bit draws (int64 tensor of ``x``'s shape) for stochastic rounding
    onto the master grid, or None for nearest rounding (ties away from zero). Inputs already
    on the grid (every fp32 value for bf16 + int16) are exact either way.
    """
    k = _EXTRA_BITS[correction_dtype]
    x = x.float()
    pattern = x.view(torch.int32)
    negative = pattern < 0
    a = (pattern & 0x7FFFFFFF).clamp(max=_F32_MAG_MAX)  # non-finite inputs are replaced below

    if dtype == torch.bfloat16:
        if k == 16:
            code = a
        else:
            r = (bits >> 24).to(torch.int32) if bits is not None else 0x80
            code = (a + r) >> 8
    elif dtype == torch.float16:
        n = (a.clamp(max=_F16_CLAMP) - _F16_REBIAS).clamp(min=0)
        if k == 16:
            normal_code = n << 3
        else:
            r = (bits >> 27).to(torch.int32) if bits is not None else 0x10
            normal_code = (n + r) >> 5
        # fp16 subnormal range: fixed point with 2**-(24 + k) steps; the product is exact and so is
        # its fraction, which the 24-bit draw (or one half, for nearest) decides on.
        y = x.abs().clamp(max=2.0**-14) * 2.0 ** (24 + k)
        whole = y.floor()
        frac = y - whole
        if bits is not None:
            up = (bits >> 8).to(torch.float32) * 2.0**-24 < frac
        else:
            up = frac >= 0.5
        small_code = whole.to(torch.int32) + up.to(torch.int32)
        code = torch.where(a >= _F16_MIN_NORMAL, normal_code, small_code)
    else:
        raise TypeError(f"master-weight splitting is for bf16/fp16 parameters, not {dtype}")

    head_max = _HEAD_MAX[dtype]
    half = 1 << (k - 1)
    code = code.clamp(max=(head_max << k) + half - 1)  # saturate instead of rounding to inf
    h = (code + half) >> k
    correction = code - (h << k)

    head_bits = torch.where(negative, h | 0x8000, h)
    head = _to_int16(head_bits).view(dtype)
    finite = torch.isfinite(x)
    head = torch.where(finite, head, x.to(dtype))
    correction = torch.where(finite, correction, 0).to(correction_dtype)
    return head, correction


def join_master(head: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """(head, correction) -> the fp32 master (exact inverse of ``split_master``)."""
    k = _EXTRA_BITS[correction.dtype]
    head_bits = head.view(torch.int16).to(torch.int32) & 0xFFFF
    sign = (head_bits & 0x8000) << 16
    code = (((head_bits & 0x7FFF) << k) + correction.to(torch.int32)).clamp(min=0)
    if head.dtype == torch.bfloat16:
        a = code << (16 - k)
    elif head.dtype == torch.float16:
        normal = code >= (1 << (10 + k))
        normal_a = (code >> 3 if k == 16 else code << 5) + _F16_REBIAS
        small_a = (code.to(torch.float32) * 2.0 ** -(24 + k)).view(torch.int32)
        a = torch.where(normal, normal_a, small_a)
    else:
        raise TypeError(f"master-weight splitting is for bf16/fp16 parameters, not {head.dtype}")
    master = (a | sign).view(torch.float32)
    return torch.where(torch.isfinite(head), master, head.float())


# --- the interface used by the update and by checkpoints -----------------------------------


def read_master(param: torch.Tensor, state: dict, master_weight_bits) -> torch.Tensor:
    """The full-precision (fp32) master value of ``param`` (``state``: its optimizer state)."""
    correction = state.get(MASTER_CORRECTION)
    if not is_split(param, master_weight_bits) or correction is None:
        return param.float()
    return join_master(param, correction)


def master_value(param: torch.Tensor, state: dict | None, master_weight_bits) -> torch.Tensor:
    """``read_master`` as a new fp32 tensor, detached (never ``param`` itself)."""
    with torch.no_grad():
        master = read_master(param.detach(), state or {}, master_weight_bits)
        return master.clone() if master.data_ptr() == param.data_ptr() else master


def _correction_dtype(state: dict, master_weight_bits) -> torch.dtype:
    dtype = CORRECTION_DTYPES[master_weight_bits]
    held = state.get(MASTER_CORRECTION)
    if held is not None and held.dtype != dtype:
        raise ValueError(
            f"the optimizer state holds a {held.dtype} master_correction but the group asks for "
            f"master_weight_bits={master_weight_bits} ({dtype}); change master_weight_bits through "
            "state_dict()/load_state_dict(), which converts the correction, not in a live group"
        )
    return dtype


def write_master(
    param: torch.Tensor, value: torch.Tensor, state: dict, master_weight_bits, bits
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Store fp32 ``value``: the new parameter tensor and the new state entries of the scheme.

    ``bits`` lazily draws uniform bits for stochastic rounding. Nothing is written here; the
    caller commits (so a skipped update leaves everything untouched).
    """
    if param.dtype == torch.float32:
        return value, {}
    if master_weight_bits is None:
        return round_stochastic(value, bits(), param.dtype), {}
    correction_dtype = _correction_dtype(state, master_weight_bits)
    exact = param.dtype == torch.bfloat16 and correction_dtype == torch.int16  # nothing to round
    head, correction = split_master(value, param.dtype, correction_dtype, None if exact else bits())
    return head, {MASTER_CORRECTION: correction}


def set_master(param: torch.Tensor, state: dict, master_weight_bits, value: torch.Tensor) -> None:
    """Make the master of ``param`` equal fp32 ``value`` (nearest rounding), writing param and state."""
    with torch.no_grad():
        value = value.detach().to(device=param.device, dtype=torch.float32)
        if not is_split(param, master_weight_bits):
            param.copy_(value)  # fp32: exact; None: round to nearest, as a model load does
            return
        correction_dtype = _correction_dtype(state, master_weight_bits)
        head, correction = split_master(value, param.dtype, correction_dtype, None)
        param.copy_(head)
        if MASTER_CORRECTION in state:
            state[MASTER_CORRECTION].copy_(correction)
        else:
            state[MASTER_CORRECTION] = correction


def convert_correction(param: torch.Tensor, master_weight_bits, saved, where: str) -> dict[str, torch.Tensor]:
    """A checkpoint's ``master_correction`` (or None) -> this optimizer's entries for ``param``.

    Lossless only: copied when it matches, widened int8 -> int16, narrowed or dropped only when
    no bit is lost; a missing one is zero (the master is the loaded parameter value).
    """
    expected = correction_zeros(param, master_weight_bits).get(MASTER_CORRECTION)
    if saved is None:
        return {} if expected is None else {MASTER_CORRECTION: expected}
    if not isinstance(saved, torch.Tensor) or saved.dtype not in _EXTRA_BITS or saved.shape != param.shape:
        got = f"{saved.dtype} {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise ValueError(
            f"master_correction of {where} must be an int8 or int16 tensor of the parameter's shape, got {got}"
        )
    saved = saved.detach().to(param.device)
    if expected is None:
        if bool((saved == 0).all()):
            return {}
        target = "fp32 parameters are their own master" if param.dtype == torch.float32 else "master_weight_bits=None"
        raise ValueError(
            f"checkpoint holds a non-zero master_correction for {where}, but {target}: dropping it would lose "
            "the low bits of the master. Load with the saved configuration, or move full-precision weights "
            "with fusedopt.master_state_dict / fusedopt.load_master_state_dict"
        )
    if saved.dtype == expected.dtype:
        return {MASTER_CORRECTION: saved.clone()}
    if saved.dtype == torch.int8:  # 24 -> 32: the int8 grid is every 256th int16 step
        return {MASTER_CORRECTION: saved.to(torch.int16) * 256}
    if bool((saved % 256 == 0).all()):  # 32 -> 24, exactly representable
        return {MASTER_CORRECTION: torch.div(saved, 256, rounding_mode="floor").to(torch.int8)}
    raise ValueError(
        f"master_correction of {where} is int16 (master_weight_bits=32) and cannot be narrowed to int8 "
        "(master_weight_bits=24) without losing bits; load it with master_weight_bits=32"
    )
