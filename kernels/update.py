"""The fused optimizer step: one launch per parameter does decode -> update -> write -> encode.

Two kernels per parameter update:

1. ``_check_kernel`` finds out whether the gradient is finite and commits the step bookkeeping
   on the device: ``step += ok``, ``skipped += !ok``, a status word the update reads and AdamW's
   bias corrections for the new step (fp64 math once per parameter, not once per update
   program). No host synchronisation. Unclipped, it reads the gradient (its last program, a
   ticket counter, commits); clipped, the coefficient already says it (``fusedopt.gradients``:
   NaN where the gradient's norm is not finite): one program per parameter reads that one word
   and hands the coefficient to the update through the scratch words.
2. ``_update_kernel`` reads gradient, parameter (and correction) and the encoded moments,
   applies AdamW / SGD / Lion in fp32 registers exactly as ``fusedopt.reference`` orders the
   operations, writes the parameter and re-encodes the moments (new block scales included).
   If the status says the gradient was not finite, nothing is stored.

Per-step scalars (lr, betas, the step count, bias corrections) are runtime values: changing
them never recompiles. The step count lives in device memory; the bias corrections are
computed from it in fp64 by the check kernel and handed over in the scratch words.

A program loads its tile as stored (``_load_tile``) and then decodes, updates and encodes it
(``_update_tile``), one tile per program. A tile wholly inside its tensor takes a copy of that code
compiled without bound checks (no masks, no selects for the padding); a tensor's partial last tile the other.

``n_elements`` is specialised by Triton (a multiple of 16 or not): with the hint the masks
are uniform per 16 elements and every load and store is a vector access; without it (odd
sizes) they are element by element. Two compiled variants per configuration at most.

NOTE: never autotune these kernels: they update their inputs in place, and autotuning runs
a kernel several times. Block sizes and warps are fixed here.
"""

import functools
import math
import struct

import torch
import triton
import triton.language as tl

from fusedopt import rng
from fusedopt.codecs.base import NO_MOMENT, Family, KernelFormat, first_draws_whole
from fusedopt.kernels.hashing import second_word, shared_word_fields, step_hash, tile_bits
from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig, launch_remembered
from fusedopt.kernels.master import decode_master, load_master_raw, store_master
from fusedopt.kernels.moments import (
    INTERPRETED,
    approximate_div,
    commit_mask,
    decode_moment,
    load_moment_raw,
    store_moment,
    tile_offsets,
    top_uniform,
)
from fusedopt.kernels.normalised import decode_normalised, load_normalised_raw, store_normalised
from fusedopt.kernels.rootgrid import decode_root_grid, load_root_grid_raw, store_root_grid
from fusedopt.master import MASTER_CORRECTION

# The algorithm branches of _update_kernel (ALGO): an algorithm's file names its branch as kernel_id.
ADAMW, SGD, LION = 0, 1, 2
KERNEL_IDS = {ADAMW: "AdamW", SGD: "SGD", LION: "Lion"}
_ADAMW, _SGD, _LION = tl.constexpr(ADAMW), tl.constexpr(SGD), tl.constexpr(LION)
# Elements per update program (a multiple of every quantisation block) and warps: 16 elements per
# thread, so each thread's fixed work (hash row keys, scalars, scale handling) spreads over more
# elements; chosen by A/B runs of benchmarks/step_ab.py --variants (at commit 7d4d420) against other
# tiles and warp counts (benchmarks/RESULTS.md).
BLOCK = 1024
NUM_WARPS = 2
# (elements, warps) of a program whose moments use the root-grid / normalised codes (norm2-root4): their
# decode and encode hold more values per element; 8 elements a thread, as 16 took as long with fewer programs
# resident and 32 longer (A/B of step_speed.py --root-grid-tiles, benchmarks/RESULTS.md); any multiple of their
# blocks gives the same bits
ROOT_GRID_TILE = (1024, 4)
# The same for a 16-bit parameter without a master correction (no split and join holding registers): 16 elements
# a thread, as the issue-bound update then spends fewer per-program instructions per element (A/B of
# step_speed.py --root-grid-tiles)
ROOT_GRID_UNCORRECTED_TILE = (1024, 2)
# Registers per thread of that program (Triton's maxnreg): capped, more programs stay resident, and the step is
# shorter than with the compiler's choice (A/B of step_speed.py --constants MAX_REGISTERS=..., benchmarks/RESULTS.md)
ROOT_GRID_UNCORRECTED_MAX_REGISTERS = 128
# (elements, warps) of a program of 4-bit block codes with a master correction (state_bits=4's default):
# the correction's split and join on 16 elements a thread took 130 registers; at 8 the step is shorter (A/B
# of step_speed.py --block-tiles, benchmarks/RESULTS.md). Without a correction BLOCK, NUM_WARPS is faster.
NIBBLE_MASTER_TILE = (512, 2)
# AdamW's sqrt(v) and division with the GPU's approximate instructions (within 2 ulp, about 10 fewer per
# element) wherever _needs_ieee_denominator allows; False: IEEE everywhere, as the reference. The interpreter
# computes both exactly. The A/B: benchmarks/denominator_ab.sh.
APPROXIMATE_DENOMINATOR = True
# The same for norm2-root4 (its root grid's square root, its direction's and its normalised encode's divisions:
# moments.approximate_div); the A/B: SWITCH=APPROXIMATE_ROOT_GRID bash benchmarks/denominator_ab.sh.
APPROXIMATE_ROOT_GRID = True
# AdamW's division by div.approx.ftz (moments.approximate_div, 2 instructions where div.full takes about 8) where
# the approximate denominator is on and v is not a root grid's; the A/B: SWITCH=APPROXIMATE_DIVISION bash
# benchmarks/denominator_ab.sh (benchmarks/RESULTS.md, "How we chose").
APPROXIMATE_DIVISION = True
MAX_REGISTERS = None  # per thread (Triton's maxnreg) of every update program; None: each tile's own choice
CHECK_TILE = 2048  # elements per iteration of the finite check
CHECK_TILES = 8  # iterations per check program (fewer programs: fewer ticket atomics)
# int32 words of the per-parameter scratch buffer: non-finite flag, ticket, status, then as fp32 bit
# patterns step_size, 1/sqrt(bias_correction2) and the clipping coefficient (SCALE_GRAD)
SCRATCH_WORDS = 8
_FLAG, _TICKET, _STATUS, _STEP_SIZE, _INV_BC2_SQRT, _COEFFICIENT = (tl.constexpr(i) for i in range(6))
# Bucketed launches (kernels/bucket.py): one launch updates up to BUCKET_TENSORS parameters of one
# configuration. Each parameter's pointers are the first member's plus a delta from a per-member
# table row; the gradients' deltas change every step and arrive as integer arguments, biased
# into int64 range so Triton always types them alike (no recompile, no host-device copy).
BUCKET_TENSORS = 16
GRAD_DELTA_BIAS = 1 << 62
# columns of a bucket's table row (int64): pointer deltas in elements of the first member's
# tensor, the member's sizes and hash keys, and the first update and check program of the
# launch that is the member's (a table has BUCKET_TENSORS rows: unused ones start at NO_START)
(
    COL_PARAM, COL_CORR, COL_M, COL_M_SCALE, COL_V, COL_V_SCALE, COL_STEP, COL_SCRATCH,
    COL_N, COL_N_PAIRS, COL_KEY_SHARED, COL_KEY_PARAM, COL_CHECK_PROGRAMS, COL_UPDATE_START, COL_CHECK_START,
    COL_FIRST,
) = (tl.constexpr(i) for i in range(16))  # fmt: skip
TABLE_COLS = 16
NO_START = 1 << 62
_BUCKET_ROWS = tl.constexpr(BUCKET_TENSORS)
_TABLE_COLS = tl.constexpr(TABLE_COLS)
NO_GRAD_DELTAS = (GRAD_DELTA_BIAS,) * BUCKET_TENSORS  # a single-parameter launch
_GRAD_DELTA_BIAS = tl.constexpr(GRAD_DELTA_BIAS)
# The global index of a parameter's element 0 (a shard's offset in its parameter, for the random
# draws), biased as the gradient deltas so Triton always types it int64
INDEX_BIAS = 1 << 62
_INDEX_BIAS = tl.constexpr(INDEX_BIAS)
# a moment's FAMILY (fusedopt.codecs.base.Family); the plain ones are kernels/moments.py's
_NONE = tl.constexpr(Family.NONE)
_NORMALISED = tl.constexpr(Family.NORMALISED)
_ROOT_GRID = tl.constexpr(Family.ROOT_GRID)
_ROOT_BLOCK = tl.constexpr(128)  # the root grid's blocks (kernels/rootgrid.py) and the normalised codes'
_NORM_BLOCK = tl.constexpr(64)
# n_elements and n_pairs of a tile wholly inside its tensor: an int64 above every offset (int32 offsets are
# widened), so the compiler folds each bound check `offset < n` to true
_WHOLE_TILE = tl.constexpr(1 << 40)
# False: the update kernel without its branch for a partial last tile (benchmarks/kernel_instructions.py's
# setting: its static count is then the path every other tile takes)
_PARTIAL_TILES = tl.constexpr(True)


@triton.jit
def _as_f32(x):
    """A runtime scalar argument as an fp32 tensor (a Python float in the interpreter).

    A cast, not ``x + 0.0``: on the GPU the argument is fp32 already and the cast is free, where
    the add cost an instruction per scalar (and turned a -0.0 argument into +0.0)."""
    return tl.cast(x, tl.float32)


# sqrt.approx flushes a subnormal v to zero, moving the denominator by under sqrt(2**-126) * c = 2**-63 * c
# (c = 1/sqrt(bias_correction2)): at most 2**-24 of eps from this eps up; below it sqrt_rn runs.
_FLUSH_SAFE_EPS = tl.constexpr(2.0**-39)


@triton.jit
def _adam_direction(m, v, c, eps, IEEE: tl.constexpr, APPROXIMATE_DIV: tl.constexpr):
    """AdamW's m / (sqrt(v) * c + eps), c = 1/sqrt(bias_correction2), in torch.optim.AdamW's order: IEEE, or
    the approximate square root (sqrt.approx) and division (div.full, or div.approx.ftz: ``APPROXIMATE_DIV``)."""
    if IEEE:
        direction = tl.div_rn(m, tl.sqrt_rn(v) * c + eps)
    elif eps >= _FLUSH_SAFE_EPS * c:  # one branch per program; the denominator is in approximate_div's range
        if APPROXIMATE_DIV:
            direction = approximate_div(m, tl.sqrt(v) * c + eps)
        else:
            direction = m / (tl.sqrt(v) * c + eps)
    else:
        direction = m / (tl.sqrt_rn(v) * c + eps)  # rare branch (not in kernel_instructions.py's fast path)
    return direction


@triton.jit
def _adam_direction_of_root(m, v, root, c, eps, IEEE: tl.constexpr):
    """``_adam_direction`` given root = sqrt(v), IEEE or approximate as ``IEEE`` says (the root grid's encode
    takes the same square root)."""
    if IEEE:
        direction = tl.div_rn(m, root * c + eps)
    elif eps >= _FLUSH_SAFE_EPS * c:  # the denominator is at least 2**-39: in approximate_div's range
        direction = approximate_div(m, root * c + eps)
    else:
        direction = m / (tl.sqrt_rn(v) * c + eps)  # rare branch (not in kernel_instructions.py's fast path)
    return direction


@triton.jit
def _scaled(x, scale):
    """``x * scale`` in fp32, rounded to nearest-even to ``x``'s dtype (returned in fp32): the
    gradient as clipping in place (``fusedopt.clipping.scale_``) leaves it. A GPU rounds to bf16 in
    one conversion; Triton's CPU interpreter truncates that cast, so there it is integer arithmetic
    (the same bits)."""
    y = x.to(tl.float32) * scale
    if x.dtype == tl.bfloat16 and INTERPRETED:
        bits = y.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        y = tl.where(y != y, y, rounded)
    elif x.dtype == tl.bfloat16:
        y = y.to(tl.bfloat16).to(tl.float32)
    elif x.dtype == tl.float16:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rebase(ptr, row, col: tl.constexpr):
    """A bucket member's pointer: the first member's plus the delta in column ``col`` of its row.

    Members are 16-byte aligned (bucket.py checks it); the hint keeps that alignment, which the
    vector loads and stores need. (A hint must be set where its value is computed: on a function
    argument it is lost.)"""
    delta = tl.multiple_of(tl.load(row + col), 128 // ptr.dtype.element_ty.primitive_bitwidth)
    return ptr + delta


@triton.jit
def _bucket_member(table_ptr, start_col: tl.constexpr):
    """(member, its program index, its table row) of this program of a bucketed launch: the
    member is the last whose first program (column ``start_col``) is not after this one. Once
    per program of BLOCK elements; a map per program would cost 8 bytes per program of
    device memory for every bucket composition."""
    pid = tl.program_id(0)
    starts = tl.load(table_ptr + tl.arange(0, _BUCKET_ROWS) * _TABLE_COLS + start_col)
    member = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    row = table_ptr + member * _TABLE_COLS
    return member, pid - tl.load(row + start_col).to(tl.int32), row


@triton.jit
def _member_delta(
    member, gd0, gd1, gd2, gd3, gd4, gd5, gd6, gd7, gd8, gd9, gd10, gd11, gd12, gd13, gd14, gd15
):  # fmt: skip
    """Member ``member``'s delta among the per-step arguments (which carry GRAD_DELTA_BIAS)."""
    d = tl.where(member == 0, gd0, gd1)
    d = tl.where(member == 2, gd2, d)
    d = tl.where(member == 3, gd3, d)
    d = tl.where(member == 4, gd4, d)
    d = tl.where(member == 5, gd5, d)
    d = tl.where(member == 6, gd6, d)
    d = tl.where(member == 7, gd7, d)
    d = tl.where(member == 8, gd8, d)
    d = tl.where(member == 9, gd9, d)
    d = tl.where(member == 10, gd10, d)
    d = tl.where(member == 11, gd11, d)
    d = tl.where(member == 12, gd12, d)
    d = tl.where(member == 13, gd13, d)
    d = tl.where(member == 14, gd14, d)
    d = tl.where(member == 15, gd15, d)
    return d - _GRAD_DELTA_BIAS


@triton.jit
def _grad_pointer(
    grad_ptr, member, gd0, gd1, gd2, gd3, gd4, gd5, gd6, gd7, gd8, gd9, gd10, gd11, gd12, gd13, gd14, gd15
):  # fmt: skip
    """Member ``member``'s gradient: ``grad_ptr`` plus its delta (16-byte aligned, as ``_rebase``)."""
    d = _member_delta(member, gd0, gd1, gd2, gd3, gd4, gd5, gd6, gd7, gd8, gd9, gd10, gd11, gd12, gd13, gd14, gd15)
    return grad_ptr + tl.multiple_of(d, 128 // grad_ptr.dtype.element_ty.primitive_bitwidth)


@triton.jit
def _bias_corrections(step, lr, log2_beta1_hi, log2_beta1_lo, log2_beta2_hi, log2_beta2_lo):
    """AdamW's step size and 1/sqrt(bias_correction2) for ``step``, in fp64 as the reference."""
    step64 = step.to(tl.float64)
    # beta**step in fp64 from log2(beta) passed as two fp32 halves (~48 bits)
    log2_beta1 = _as_f32(log2_beta1_hi).to(tl.float64) + _as_f32(log2_beta1_lo).to(tl.float64)
    log2_beta2 = _as_f32(log2_beta2_hi).to(tl.float64) + _as_f32(log2_beta2_lo).to(tl.float64)
    bias_correction1 = 1.0 - tl.exp2(step64 * log2_beta1)
    bias_correction2 = 1.0 - tl.exp2(step64 * log2_beta2)
    step_size = (_as_f32(lr).to(tl.float64) / bias_correction1).to(tl.float32)
    inv_bias_correction2_sqrt = (1.0 / tl.sqrt(bias_correction2)).to(tl.float32)  # fp64: IEEE
    return step_size, inv_bias_correction2_sqrt


@triton.jit(do_not_specialize=[f"gd{i}" for i in range(BUCKET_TENSORS)])
def _check_kernel(
    grad_ptr,  # this step's gradient
    accum_ptr,  # gradient accumulated by the optimizer (HAS_ACCUM)
    scratch_ptr,  # int32[SCRATCH_WORDS]: flag, ticket, status, step_size, 1/sqrt(bc2), coefficient
    step_ptr,  # fp32 0-d step count
    skipped_ptr,  # int64 0-d skipped-update counter
    table_ptr,  # BUCKET: int64 rows of the members' deltas, sizes and first programs
    grad_scale_ptr,  # SCALE_GRAD: fp32 0-d coefficient of the gradients (clipping; NaN: not finite)
    n_elements,
    # BUCKET: the members' gradient deltas (+ GRAD_DELTA_BIAS); SCALE_GRAD: their coefficients' deltas
    gd0,
    gd1,
    gd2,
    gd3,
    gd4,
    gd5,
    gd6,
    gd7,
    gd8,
    gd9,
    gd10,
    gd11,
    gd12,
    gd13,
    gd14,
    gd15,
    lr,
    log2_beta1_hi,  # AdamW bias corrections: log2(beta) = hi + lo
    log2_beta1_lo,
    log2_beta2_hi,
    log2_beta2_lo,
    HAS_ACCUM: tl.constexpr,
    BIAS_CORRECTIONS: tl.constexpr,
    TILE: tl.constexpr,
    TILES: tl.constexpr,
    BUCKET: tl.constexpr,  # one launch over several parameters (kernels/bucket.py)
    SCALE_GRAD: tl.constexpr,  # the gradients are multiplied by *grad_scale_ptr, whose NaN is the verdict
):
    if SCALE_GRAD:
        # The coefficient is NaN exactly where the gradient's norm is not finite (fusedopt.gradients):
        # no gradient read, one program per parameter. It passes the coefficient on to the update.
        if BUCKET:  # program i: member i
            member = tl.program_id(0)
            row = table_ptr + member * _TABLE_COLS
            delta = _member_delta(
                member, gd0, gd1, gd2, gd3, gd4, gd5, gd6, gd7, gd8, gd9, gd10, gd11, gd12, gd13, gd14, gd15
            )  # fmt: skip
            grad_scale_ptr += delta
            scratch_ptr = _rebase(scratch_ptr, row, COL_SCRATCH)
            step_ptr = _rebase(step_ptr, row, COL_STEP)
        grad_scale = tl.load(grad_scale_ptr)
        tl.store(scratch_ptr + _COEFFICIENT, grad_scale.to(tl.int32, bitcast=True))
        _commit_step(
            (grad_scale != grad_scale).to(tl.int32), scratch_ptr, step_ptr, skipped_ptr, lr, log2_beta1_hi,
            log2_beta1_lo, log2_beta2_hi, log2_beta2_lo, BIAS_CORRECTIONS,
        )  # fmt: skip
    else:
        if BUCKET:
            member, program, row = _bucket_member(table_ptr, COL_CHECK_START)
            grad_ptr = _grad_pointer(
                grad_ptr, member, gd0, gd1, gd2, gd3, gd4, gd5, gd6, gd7, gd8, gd9, gd10, gd11, gd12, gd13, gd14, gd15
            )
            scratch_ptr = _rebase(scratch_ptr, row, COL_SCRATCH)
            step_ptr = _rebase(step_ptr, row, COL_STEP)
            n_elements = tl.multiple_of(tl.load(row + COL_N).to(tl.int32), 16)
            programs = tl.load(row + COL_CHECK_PROGRAMS).to(tl.int32)
        else:
            program = tl.program_id(0)
            programs = tl.num_programs(0)
        start = program.to(tl.int64) * (TILE * TILES)
        # g * 0 is +-0 for a finite g and NaN for an inf or a NaN, and a NaN survives every add: one
        # multiply-add per element, and one reduction per program rather than one (with two block
        # barriers) per tile
        poison = tl.zeros([TILE], tl.float32)
        # unrolled: every tile's loads are issued before the first is used (a rolled loop waited for
        # each tile's loads in turn: measurably slower, benchmarks/RESULTS.md)
        for i in tl.static_range(TILES):
            offs = start + i * TILE + tl.arange(0, TILE).to(tl.int64)
            mask = offs < n_elements
            g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_ACCUM:
                g += tl.load(accum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            poison += g * 0.0
        bad = tl.max((poison != poison).to(tl.int32), axis=0)
        tl.atomic_max(scratch_ptr + _FLAG, bad, mask=bad > 0)
        ticket = tl.atomic_add(scratch_ptr + _TICKET, 1)
        if ticket == programs - 1:  # the parameter's last program: every flag is in
            final = tl.atomic_xchg(scratch_ptr + _FLAG, 0)
            _commit_step(
                final, scratch_ptr, step_ptr, skipped_ptr, lr, log2_beta1_hi, log2_beta1_lo, log2_beta2_hi,
                log2_beta2_lo, BIAS_CORRECTIONS,
            )  # fmt: skip
            tl.store(scratch_ptr + _TICKET, 0)


@triton.jit
def _commit_step(
    bad, scratch_ptr, step_ptr, skipped_ptr, lr, log2_beta1_hi, log2_beta1_lo, log2_beta2_hi, log2_beta2_lo,
    BIAS_CORRECTIONS: tl.constexpr,
):  # fmt: skip
    """The check's verdict ``bad`` (1: skip) for the update: the status word, the step count, AdamW's
    bias corrections for the new step, the skipped counter."""
    tl.store(scratch_ptr + _STATUS, bad)
    step = tl.load(step_ptr) + (1 - bad).to(tl.float32)
    tl.store(step_ptr, step)
    if BIAS_CORRECTIONS:
        step_size, inv_bc2_sqrt = _bias_corrections(
            step, lr, log2_beta1_hi, log2_beta1_lo, log2_beta2_hi, log2_beta2_lo
        )
        tl.store(scratch_ptr + _STEP_SIZE, step_size.to(tl.int32, bitcast=True))
        tl.store(scratch_ptr + _INV_BC2_SQRT, inv_bc2_sqrt.to(tl.int32, bitcast=True))
    tl.atomic_add(skipped_ptr, bad.to(tl.int64), mask=bad != 0)  # atomic: a bucket's members race


@triton.jit
def _tile_start(tile, TILE: tl.constexpr, INDEX_64: tl.constexpr):
    """The first element of a tile (32-bit address arithmetic is cheaper: used below 2**31 elements)."""
    if INDEX_64:
        start = tile.to(tl.int64) * TILE
    else:
        start = tile * TILE
    return start


@triton.jit
def _load_tile(
    start, grad_ptr, accum_ptr, param_ptr, corr_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, n_elements, n_pairs,
    MASTER: tl.constexpr, HAS_ACCUM: tl.constexpr, M_FAMILY: tl.constexpr, M_BITS: tl.constexpr,
    V_FAMILY: tl.constexpr, V_BITS: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """Everything the update of the tile at ``start`` reads, as stored (``_update_tile`` decodes it); past the
    tensor's end nothing is read."""
    offs = tile_offsets(start, NB, QBLOCK)
    mask = offs < n_elements
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    accum = 0
    if HAS_ACCUM:
        accum = tl.load(accum_ptr + offs, mask=mask, other=0.0)
    head, correction = load_master_raw(param_ptr, corr_ptr, offs, mask, MASTER)
    if M_FAMILY == _NORMALISED:
        m_stored, m_scales = load_normalised_raw(
            m_ptr, m_scale_ptr, start, n_elements, M_BITS, NB * QBLOCK // _NORM_BLOCK
        )
    else:
        m_stored, m_scales = load_moment_raw(
            m_ptr, m_scale_ptr, start, n_elements, n_pairs, M_FAMILY, M_BITS, NB, QBLOCK
        )
    if V_FAMILY == _ROOT_GRID:
        v_stored, v_scales = load_root_grid_raw(v_ptr, v_scale_ptr, start, n_elements, NB * QBLOCK // _ROOT_BLOCK)
    else:
        v_stored, v_scales = load_moment_raw(
            v_ptr, v_scale_ptr, start, n_elements, n_pairs, V_FAMILY, V_BITS, NB, QBLOCK
        )
    return g, accum, head, correction, m_stored, m_scales, v_stored, v_scales


@triton.jit
def _update_tile(
    start,  # the tile's first element
    hash_start,  # and its hash index
    grad_ptr, accum_ptr, param_ptr, corr_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, n_elements, n_pairs,
    status, step, step_size, inv_bias_correction2_sqrt, grad_scale,
    shared_hash, param_hash,  # step_hash of the two keys
    lr, beta1, beta2, eps, decay, weight_decay, lerp_weight, one_minus_beta2, v_decay, v_decay_root,
    ALGO: tl.constexpr, MASTER: tl.constexpr, PARAM_BF16: tl.constexpr, CORR_BITS: tl.constexpr,
    STOCHASTIC_MASTER: tl.constexpr, PARAM_OWN_DRAW: tl.constexpr, HAS_ACCUM: tl.constexpr, MAXIMIZE: tl.constexpr,
    NESTEROV: tl.constexpr,
    M_FAMILY: tl.constexpr, M_BITS: tl.constexpr, M_SIGNED: tl.constexpr, M_POWER: tl.constexpr,
    M_QMAX: tl.constexpr, M_K: tl.constexpr, M_MIN_E: tl.constexpr, M_THR: tl.constexpr, M_TOP: tl.constexpr,
    M_CLIP: tl.constexpr,
    V_FAMILY: tl.constexpr, V_BITS: tl.constexpr, V_SIGNED: tl.constexpr, V_POWER: tl.constexpr,
    V_QMAX: tl.constexpr, V_K: tl.constexpr, V_MIN_E: tl.constexpr, V_THR: tl.constexpr, V_TOP: tl.constexpr,
    NB: tl.constexpr, QBLOCK: tl.constexpr, SCALE_GRAD: tl.constexpr, IEEE_DENOMINATOR: tl.constexpr,
    APPROXIMATE_DIV: tl.constexpr,
    WHOLE: tl.constexpr,  # the tile lies wholly inside the tensor
):  # fmt: skip
    """Load, decode, update and re-encode one tile (the update kernel's arguments, as it documents them)."""
    if WHOLE:  # bounds above every offset: the compiler drops the masks and the padding's selects
        n_elements = tl.full([], _WHOLE_TILE, tl.int64)
        n_pairs = n_elements
    g, accum, head, correction, m_stored, m_scales, v_stored, v_scales = _load_tile(
        start, grad_ptr, accum_ptr, param_ptr, corr_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, n_elements, n_pairs,
        MASTER, HAS_ACCUM, M_FAMILY, M_BITS, V_FAMILY, V_BITS, NB, QBLOCK,
    )  # fmt: skip
    # Issue every load before any arithmetic: the compiler would otherwise sink some next to
    # their first use, and each program would wait for memory more than once.
    tl.debug_barrier()
    # fp32 scalars everywhere (the interpreter would otherwise compute with Python doubles)
    lr, beta1, beta2, eps, decay = _as_f32(lr), _as_f32(beta1), _as_f32(beta2), _as_f32(eps), _as_f32(decay)
    weight_decay, lerp_weight, one_minus_beta2 = (
        _as_f32(weight_decay),
        _as_f32(lerp_weight),
        _as_f32(one_minus_beta2),
    )
    offs = tile_offsets(start, NB, QBLOCK)
    mask = offs < n_elements
    if SCALE_GRAD:
        g = _scaled(g, grad_scale)
    g = g.to(tl.float32)
    if HAS_ACCUM:
        if SCALE_GRAD:
            accum = _scaled(accum, grad_scale)
        g += accum.to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = decode_master(head, correction, MASTER, PARAM_BF16, CORR_BITS)
    ROOT_ROWS: tl.constexpr = NB * QBLOCK // _ROOT_BLOCK  # the tile in rows of one root-grid block
    NORM_ROWS: tl.constexpr = NB * QBLOCK // _NORM_BLOCK
    if M_FAMILY != _NORMALISED:  # (a normalised m is decoded below, in units of v as decoded)
        m = decode_moment(m_stored, m_scales, M_FAMILY, M_BITS, M_SIGNED, M_POWER, M_QMAX, M_K, M_MIN_E, NB, QBLOCK)
    if V_FAMILY == _ROOT_GRID:  # the codes, units and roots stay for the encode (and m's decode)
        v_codes, v_units, v_roots = decode_root_grid(v_stored, v_scales, ROOT_ROWS)
        v_values = v_roots * v_roots
        v = tl.reshape(v_values, [NB, QBLOCK])
    else:
        v = decode_moment(v_stored, v_scales, V_FAMILY, V_BITS, V_SIGNED, V_POWER, V_QMAX, V_K, V_MIN_E, NB, QBLOCK)
    if M_FAMILY == _NORMALISED:  # m in units of sqrt(v) as decoded (0 past the end)
        tl.static_assert(V_FAMILY == _ROOT_GRID, "a normalised first moment needs a root-grid second moment")
        # sqrt(v) is the stored root (RootGridCodec.roots)
        root = tl.reshape(tl.where(mask, tl.reshape(v_roots, [NB, QBLOCK]), 0.0), [NORM_ROWS, _NORM_BLOCK])
        m = tl.reshape(decode_normalised(m_stored, m_scales, root, M_BITS, NORM_ROWS), [NB, QBLOCK])
    if ALGO == _ADAMW:  # as torch.optim.AdamW orders it
        # torch.lerp: fma(w, g - m, m), or g - (g - m) * (1 - w) for w >= 0.5
        if lerp_weight < 0.5:
            m = tl.fma(lerp_weight, g - m, m)
        else:
            m = tl.fma(-(g - m), 1.0 - lerp_weight, g)
        v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # torch.addcmul
        p = p * decay
        if V_FAMILY == _ROOT_GRID:  # one square root for the direction and the encode
            if IEEE_DENOMINATOR:
                v_root = tl.sqrt_rn(v)
            else:
                v_root = tl.sqrt(v)  # approximate: a subnormal v flushed to 0
            direction = _adam_direction_of_root(m, v, v_root, inv_bias_correction2_sqrt, eps, IEEE_DENOMINATOR)
        else:
            direction = _adam_direction(m, v, inv_bias_correction2_sqrt, eps, IEEE_DENOMINATOR, APPROXIMATE_DIV)
        p = p - direction * step_size
    elif ALGO == _SGD:  # as torch.optim.SGD (torch.add(x, y, alpha=a) is fma(a, y, x))
        d = tl.fma(weight_decay, p, g)
        if M_FAMILY != _NONE:
            m = tl.where(step == 1.0, d, tl.fma(lerp_weight, d, m * beta1))
            if NESTEROV:
                d = tl.fma(beta1, m, d)
            else:
                d = m
        p = tl.fma(-lr, d, p)
    elif ALGO == _LION:
        c = m * beta1 + g * lerp_weight
        direction = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        p = tl.fma(-lr, direction, p * decay)
        m = tl.fma(one_minus_beta2, g, m * beta2)
    else:
        tl.static_assert(False, "the update kernel has no branch for this ALGO")
    # One hash per element feeds the roundings (as fusedopt.rng lays them out: moment i takes 12 bits from the
    # top down, or whole words: moment 0 this one, moment 1 this one re-mixed; a bf16 + int8 parameter the low 8, a bf16
    # parameter without a correction beside a whole-word moment 0 the low 16).
    shared = tile_bits(shared_hash, hash_start, NB, QBLOCK)
    # the parameter's field (rng.param_draw_bits): none with a word of its own; a bf16 parameter without a correction
    # shares the word only beside a whole-word first moment, and then takes its low 16
    PARAM_BITS: tl.constexpr = 0 if PARAM_OWN_DRAW else (16 if MASTER == 1 else 8)
    moment_word, param_field = shared_word_fields(shared, PARAM_BITS)
    if V_FAMILY == _ROOT_GRID:  # first: a normalised first moment is stored in units of v as stored
        # its whole word: the shared one re-mixed (fusedopt.rng.second_word; the root grid reads its top bits)
        v_draws = (second_word(shared) >> 11).to(tl.int32)  # (past the tensor's end r is 0: no draw rounds it up)
        stored_roots = store_root_grid(
            tl.reshape(v, [ROOT_ROWS, _ROOT_BLOCK]), tl.reshape(v_root, [ROOT_ROWS, _ROOT_BLOCK]), v_codes, v_units,
            v_values, _as_f32(v_decay), _as_f32(v_decay_root), tl.reshape(v_draws, [ROOT_ROWS, _ROOT_BLOCK]),
            tl.reshape(offs, [ROOT_ROWS, _ROOT_BLOCK]), v_ptr, v_scale_ptr, start, n_elements, status,
            IEEE_DENOMINATOR, ROOT_ROWS, FINITE=True,
        )  # fmt: skip
    if M_FAMILY == _NORMALISED:
        root = tl.where(mask, tl.reshape(stored_roots, [NB, QBLOCK]), 0.0)  # sqrt(v) as just stored
        m_u = tl.where(mask, top_uniform(moment_word), 0.0)  # its top 23 bits, or 16 beside the parameter's 16
        store_normalised(
            tl.reshape(m, [NORM_ROWS, _NORM_BLOCK]), tl.reshape(root, [NORM_ROWS, _NORM_BLOCK]),
            tl.reshape(m_u, [NORM_ROWS, _NORM_BLOCK]), m_ptr, m_scale_ptr, start, n_elements, status,
            M_BITS, M_CLIP, IEEE_DENOMINATOR, NORM_ROWS, FINITE=True,
        )  # fmt: skip
    else:
        store_moment(
            m,
            (shared >> 20) << 20,
            m_ptr,
            m_scale_ptr,
            start,
            n_elements,
            n_pairs,
            M_FAMILY,
            M_BITS,
            M_SIGNED,
            M_POWER,
            M_QMAX,
            M_K,
            M_MIN_E,
            M_THR,
            M_TOP,
            NB,
            QBLOCK,
            status,
        )
    if V_FAMILY != _ROOT_GRID:
        store_moment(
            v,
            ((shared << 12) >> 20) << 20,
            v_ptr,
            v_scale_ptr,
            start,
            n_elements,
            n_pairs,
            V_FAMILY,
            V_BITS,
            V_SIGNED,
            V_POWER,
            V_QMAX,
            V_K,
            V_MIN_E,
            V_THR,
            V_TOP,
            NB,
            QBLOCK,
            status,
        )
    if PARAM_OWN_DRAW:
        param_bits = tile_bits(param_hash, hash_start, NB, QBLOCK)
    else:
        param_bits = param_field
    store_master(
        p,
        param_bits,
        param_ptr,
        corr_ptr,
        offs,
        mask & commit_mask(status, NB, QBLOCK),
        MASTER,
        PARAM_BF16,
        CORR_BITS,
        STOCHASTIC_MASTER,
    )


@triton.jit(do_not_specialize=["key_shared", "key_param", "first"] + [f"gd{i}" for i in range(BUCKET_TENSORS)])
def _update_kernel(
    param_ptr,  # parameter, updated in place
    corr_ptr,  # master-weight correction (int8 / int16, MASTER == 2)
    grad_ptr,  # gradient
    accum_ptr,  # accumulated gradient (HAS_ACCUM)
    m_ptr,  # first moment / momentum: values or codes
    m_scale_ptr,  # its block scales (8/4-bit)
    v_ptr,  # AdamW second moment
    v_scale_ptr,
    step_ptr,  # step count, already advanced by the check kernel
    scratch_ptr,  # the check kernel's words: the status (non-zero: skip), bias corrections, coefficient
    table_ptr,  # BUCKET: int64 rows of the members' deltas, sizes, keys and first programs
    n_elements,
    n_pairs,  # (n_elements + 1) // 2: bytes of 4-bit codes
    key_shared,  # host parts of the hash keys (uint32): the word shared by the roundings,
    key_param,  # and the parameter's own word (PARAM_OWN_DRAW)
    first,  # the hash index of element 0 (+ INDEX_BIAS): a shard's first element in its parameter
    # BUCKET: the members' gradient deltas (+ GRAD_DELTA_BIAS)
    gd0,
    gd1,
    gd2,
    gd3,
    gd4,
    gd5,
    gd6,
    gd7,
    gd8,
    gd9,
    gd10,
    gd11,
    gd12,
    gd13,
    gd14,
    gd15,
    lr,
    beta1,  # AdamW / Lion beta1; SGD momentum
    beta2,
    eps,
    decay,  # 1 - lr * weight_decay (AdamW, Lion)
    weight_decay,  # SGD's coupled decay
    lerp_weight,  # 1 - beta1 (AdamW, Lion); 1 - dampening (SGD)
    one_minus_beta2,
    v_decay,  # the second moment's EMA decay (root grid), and its square root (the unit's decay)
    v_decay_root,
    ALGO: tl.constexpr,
    MASTER: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    CORR_BITS: tl.constexpr,  # 8 or 16 extra master bits (MASTER == 2)
    STOCHASTIC_MASTER: tl.constexpr,  # whether the split rounds (all but bf16 + int16)
    PARAM_OWN_DRAW: tl.constexpr,  # the parameter's rounding needs a word of its own (not rng.param_shares_draw)
    HAS_ACCUM: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    NESTEROV: tl.constexpr,
    M_FAMILY: tl.constexpr,  # fusedopt.codecs.base.Family
    M_BITS: tl.constexpr,
    M_SIGNED: tl.constexpr,
    M_POWER: tl.constexpr,
    M_QMAX: tl.constexpr,
    M_K: tl.constexpr,
    M_MIN_E: tl.constexpr,
    M_THR: tl.constexpr,
    M_TOP: tl.constexpr,
    M_CLIP: tl.constexpr,  # normalised codes: KernelFormat.clip
    V_FAMILY: tl.constexpr,
    V_BITS: tl.constexpr,
    V_SIGNED: tl.constexpr,
    V_POWER: tl.constexpr,
    V_QMAX: tl.constexpr,
    V_K: tl.constexpr,
    V_MIN_E: tl.constexpr,
    V_THR: tl.constexpr,
    V_TOP: tl.constexpr,
    NB: tl.constexpr,  # quantisation blocks per program
    QBLOCK: tl.constexpr,  # elements per quantisation block (the tile's row)
    INDEX_64: tl.constexpr,  # element offsets need 64 bits
    BUCKET: tl.constexpr,  # one launch over several parameters (kernels/bucket.py)
    SCALE_GRAD: tl.constexpr,  # the gradients are multiplied by the clipping coefficient
    IEEE_DENOMINATOR: tl.constexpr,  # AdamW: IEEE sqrt(v) and division (else the approximate ones)
    APPROXIMATE_DIV: tl.constexpr,  # and where approximate, the division div.approx.ftz (else div.full)
):
    if BUCKET:  # this program's member: its pointers, size and keys
        member, program, row = _bucket_member(table_ptr, COL_UPDATE_START)
        param_ptr = _rebase(param_ptr, row, COL_PARAM)
        corr_ptr = _rebase(corr_ptr, row, COL_CORR)
        grad_ptr = _grad_pointer(
            grad_ptr, member, gd0, gd1, gd2, gd3, gd4, gd5, gd6, gd7, gd8, gd9, gd10, gd11, gd12, gd13, gd14, gd15
        )
        m_ptr = _rebase(m_ptr, row, COL_M)
        m_scale_ptr = _rebase(m_scale_ptr, row, COL_M_SCALE)
        v_ptr = _rebase(v_ptr, row, COL_V)
        v_scale_ptr = _rebase(v_scale_ptr, row, COL_V_SCALE)
        step_ptr = _rebase(step_ptr, row, COL_STEP)
        scratch_ptr = _rebase(scratch_ptr, row, COL_SCRATCH)
        n_elements = tl.multiple_of(tl.load(row + COL_N).to(tl.int32), 16)
        n_pairs = tl.multiple_of(tl.load(row + COL_N_PAIRS).to(tl.int32), 8)
        key_shared = tl.load(row + COL_KEY_SHARED)
        key_param = tl.load(row + COL_KEY_PARAM)
        first = tl.load(row + COL_FIRST)
    else:
        program = tl.program_id(0)
    # A non-finite gradient (the check kernel's status) only masks the stores: branching on it
    # would hold every program for one memory round trip before its loads could start.
    status = tl.load(scratch_ptr + _STATUS)
    step = tl.load(step_ptr)
    step_size = tl.load(scratch_ptr + _STEP_SIZE).to(tl.float32, bitcast=True)  # AdamW's bias corrections
    inv_bias_correction2_sqrt = tl.load(scratch_ptr + _INV_BC2_SQRT).to(tl.float32, bitcast=True)
    grad_scale = 1.0
    if SCALE_GRAD:  # the clipping coefficient, as the check kernel passed it on
        grad_scale = tl.load(scratch_ptr + _COEFFICIENT).to(tl.float32, bitcast=True)
    # the elements' hash indices start at `first` (a multiple of 32 below 2**31 unless INDEX_64)
    if INDEX_64:
        hash_base = first - _INDEX_BIAS
    else:
        hash_base = (first - _INDEX_BIAS).to(tl.int32)
    start = _tile_start(program, NB * QBLOCK, INDEX_64)
    whole = True
    if _PARTIAL_TILES:
        whole = n_elements - start >= NB * QBLOCK
    if whole:  # every tile but a tensor's last: its bound checks fold away
        _update_tile(
            start, start + hash_base, grad_ptr, accum_ptr, param_ptr, corr_ptr, m_ptr, m_scale_ptr, v_ptr,
            v_scale_ptr, n_elements, n_pairs, status, step, step_size, inv_bias_correction2_sqrt, grad_scale,
            step_hash(key_shared, step), step_hash(key_param, step), lr, beta1, beta2, eps, decay, weight_decay,
            lerp_weight, one_minus_beta2, v_decay, v_decay_root, ALGO, MASTER, PARAM_BF16, CORR_BITS,
            STOCHASTIC_MASTER, PARAM_OWN_DRAW, HAS_ACCUM, MAXIMIZE, NESTEROV, M_FAMILY, M_BITS, M_SIGNED, M_POWER,
            M_QMAX, M_K, M_MIN_E, M_THR, M_TOP, M_CLIP, V_FAMILY, V_BITS, V_SIGNED, V_POWER, V_QMAX, V_K, V_MIN_E,
            V_THR, V_TOP, NB, QBLOCK, SCALE_GRAD, IEEE_DENOMINATOR, APPROXIMATE_DIV,
            WHOLE=True,
        )  # fmt: skip
    else:  # a tensor's last tile, when partial
        _update_tile(
            start, start + hash_base, grad_ptr, accum_ptr, param_ptr, corr_ptr, m_ptr, m_scale_ptr, v_ptr,
            v_scale_ptr, n_elements, n_pairs, status, step, step_size, inv_bias_correction2_sqrt, grad_scale,
            step_hash(key_shared, step), step_hash(key_param, step), lr, beta1, beta2, eps, decay, weight_decay,
            lerp_weight, one_minus_beta2, v_decay, v_decay_root, ALGO, MASTER, PARAM_BF16, CORR_BITS,
            STOCHASTIC_MASTER, PARAM_OWN_DRAW, HAS_ACCUM, MAXIMIZE, NESTEROV, M_FAMILY, M_BITS, M_SIGNED, M_POWER,
            M_QMAX, M_K, M_MIN_E, M_THR, M_TOP, M_CLIP, V_FAMILY, V_BITS, V_SIGNED, V_POWER, V_QMAX, V_K, V_MIN_E,
            V_THR, V_TOP, NB, QBLOCK, SCALE_GRAD, IEEE_DENOMINATOR, APPROXIMATE_DIV,
            WHOLE=False,
        )  # fmt: skip
        # ends unlike the branch above: LLVM would otherwise sink their common tail into one, masks and all
        tl.debug_barrier()


# runtime arguments: tensors, then ints (the gradient deltas last: always int64, not in the
# launch key), then floats (see PreparedUpdate)
CHECK_ARGS = dict(tensors=7, ints=1 + BUCKET_TENSORS, unkeyed_ints=BUCKET_TENSORS)
UPDATE_ARGS = dict(tensors=11, ints=5 + BUCKET_TENSORS, unkeyed_ints=BUCKET_TENSORS)
_launch_check = DirectLauncher(_check_kernel, **CHECK_ARGS)
_launch_update = DirectLauncher(_update_kernel, **UPDATE_ARGS)


@functools.lru_cache(maxsize=1024)
def _split_log2(name: str, beta: float) -> dict:
    """log2(beta) as two fp32 values whose sum carries about 48 bits (beta in (0, 1))."""
    value = math.log2(beta) if beta > 0 else -1e30
    hi = struct.unpack("f", struct.pack("f", value))[0]
    return {f"{name}_hi": hi, f"{name}_lo": value - hi}


@functools.lru_cache(maxsize=256)
def _moment_args(prefix: str, fmt: KernelFormat) -> dict:
    return {
        f"{prefix}_FAMILY": fmt.family,
        f"{prefix}_BITS": fmt.bits,
        f"{prefix}_SIGNED": fmt.signed,
        f"{prefix}_POWER": fmt.power,
        f"{prefix}_QMAX": fmt.qmax,
        f"{prefix}_K": fmt.k,
        f"{prefix}_MIN_E": fmt.min_exponent,
        f"{prefix}_THR": fmt.threshold,
        f"{prefix}_TOP": fmt.top,
    }


def unsupported(algorithm, job) -> str | None:
    """What this kernel cannot take in ``job`` (``fusedopt.dispatch`` checks devices and layout)."""
    if len(job.codecs) > 2:
        return f"the fused kernel takes at most two moments, fusedopt.{algorithm.__name__} keeps {len(job.codecs)}"
    for slot, codec in job.codecs.items():
        if codec.kernel_format is None:
            return f"the fused kernel has no branch for the state format {codec.name!r} (of {slot!r})"
    slots = list(job.codecs)
    for i, (slot, codec) in enumerate(job.codecs.items()):
        family = codec.kernel_format.family
        if family == Family.ROOT_GRID and slot not in (job.decays or {}):
            # the format keeps the decay exact on its scales (encode_decayed)
            return (
                f"the state format {codec.name!r} needs the EMA decay of {slot!r}, which "
                f"fusedopt.{algorithm.__name__} does not declare (ema_decays)"
            )
        if family == Family.ROOT_GRID and i != 1:
            return f"the fused kernel reads a {codec.name!r} moment (of {slot!r}) only as the second moment"
        if family == Family.NORMALISED:
            frame = (job.frames or {}).get(slot)
            framed = i == 0 and frame in slots[1:]
            if not (framed and job.codecs[frame].kernel_format.family == Family.ROOT_GRID):
                return (
                    f"the fused kernel stores {codec.name!r} (of {slot!r}) only in units of a root-grid second "
                    "moment of the same parameter"
                )
    return None


def launch_job(algorithm, job, scratch: torch.Tensor, scalars: tuple) -> "PreparedUpdate":
    """``launch_update`` of a checked ``fusedopt.reference.ParamUpdate`` (``fusedopt.dispatch``)."""
    state = job.state
    moments = []
    for slot, codec in job.codecs.items():
        fmt = codec.kernel_format
        values = state[slot] if fmt.family in (Family.FP32, Family.BF16) else state[slot + ".codes"]
        moments.append((fmt, values, state.get(slot + ".scales")))
    split = job.param.dtype != torch.float32 and job.master_weight_bits
    hyper = job.hyper
    return launch_update(
        algorithm.kernel_id,
        algorithm.bias_corrections,
        job.param,
        job.grad,
        job.accum,
        state.get(MASTER_CORRECTION) if split else None,
        moments,
        state["step"],
        scratch,
        job.skipped,
        (rng.host_key(job.seed, job.index, rng.STREAM_SHARED), rng.host_key(job.seed, job.index, rng.STREAM_PARAM)),
        not rng.param_shares_draw(job.param.dtype, job.master_weight_bits, first_draws_whole(job.codecs)),
        (bool(hyper.get("maximize", False)), bool(hyper.get("nesterov", False))),
        scalars,
        job.first,
    )


def launch_update(
    kernel_id: int,
    bias_corrections: bool,
    param: torch.Tensor,
    grad: torch.Tensor,
    accum: torch.Tensor | None,
    correction: torch.Tensor | None,
    moments: list[tuple[KernelFormat, torch.Tensor | None, torch.Tensor | None]],
    step: torch.Tensor,
    scratch: torch.Tensor,
    skipped: torch.Tensor,
    keys: tuple[int, int],
    param_own_draw: bool,
    flags: tuple[bool, bool],
    scalars: tuple[tuple, tuple],
    first: int = 0,
) -> "PreparedUpdate":
    """Update one parameter in place. ``moments``: up to two (format, values or codes, scales); ``keys``:
    host keys of the shared and the parameter's own random word (``fusedopt.rng``); ``flags``:
    (maximize, nesterov); ``scalars``: ``pack_scalars`` of the algorithm's ``kernel_scalars``;
    ``first``: the global index of the parameter's element 0 in the random draws (a shard's offset).

    The caller guarantees contiguous tensors on one device and supported formats
    (``fusedopt.dispatch`` checks); this only launches. Returns the parameter's
    :class:`PreparedUpdate`, which launches the next steps' updates with less host work.
    """
    prepared = PreparedUpdate(
        kernel_id, bias_corrections, param, correction, moments, step, scratch, skipped, keys, param_own_draw, flags,
        first,
    )  # fmt: skip
    prepared.launch(grad, accum, scalars)
    return prepared


class PreparedUpdate:
    """The launch arguments of one parameter's update that do not change from step to step.

    Valid while the parameter's tensors (parameter, correction, moments, step, scratch) are the
    same objects and the hyperparameters' flags (``maximize``, ``nesterov``) are unchanged: the
    optimizer checks that before reusing it (``FusedOptimizer.update_param``). Per step only the
    gradient, the accumulated gradient and the runtime scalars (lr, betas, ...) are new
    (and a clipping coefficient, which the kernel multiplies the gradients by).
    """

    takes_grad_scale = True

    def __init__(
        self,
        kernel_id,
        bias_corrections,
        param,
        correction,
        moments,
        step,
        scratch,
        skipped,
        keys,
        param_own_draw,
        flags,
        first=0,
    ):
        if kernel_id not in KERNEL_IDS:
            raise ValueError(f"the fused kernel has no branch for kernel_id {kernel_id!r}")
        n = param.numel()
        absent = (NO_MOMENT, None, None)
        (m_fmt, m_val, m_scales), (v_fmt, v_val, v_scales) = (moments + [absent] * 2)[:2]
        self.algo = algo = kernel_id
        self.bias_corrections = bias_corrections
        self.n = n
        self.dummy = dummy = param  # unused pointer arguments (their constexpr switches are off)
        self.scratch, self.step, self.skipped = scratch, step, skipped
        # plain integer division: triton.cdiv is a JIT function, ~7 us per call from Python
        self.check_programs = -(-max(n, 1) // (CHECK_TILE * CHECK_TILES))
        block, warps, max_registers = _tile(m_fmt, v_fmt, correction is not None, param.dtype == torch.float32)
        self.programs = -(-n // block)
        corr_bits = 0 if correction is None else (16 if correction.dtype == torch.int16 else 8)
        self.configs = [  # [has_accum]
            _update_config(
                algo,
                param.dtype,
                corr_bits,
                param_own_draw,
                has_accum,
                *flags,
                m_fmt,
                v_fmt,
                block,
                warps,
                max_registers if MAX_REGISTERS is None else MAX_REGISTERS,
                # 64-bit indices past 2**31, and hash indices from a `first` the 32-bit tiles cannot take
                # (a tile row must start at a multiple of its length: hashing.tile_bits)
                first + n >= 2**31 - block or first % max(32, _tile_row(m_fmt, v_fmt)) != 0,
                not APPROXIMATE_DENOMINATOR or _needs_ieee_denominator(param.dtype, corr_bits, m_fmt, v_fmt),
                APPROXIMATE_DIVISION,
            )  # fmt: skip
            for has_accum in (False, True)
        ]
        self.head = (param, correction if correction is not None else dummy)  # before the gradient
        self.state_tensors = (  # after the accumulated gradient (a bucket's table rebases them too)
            m_val if m_val is not None else dummy,
            m_scales if m_scales is not None else dummy,
            v_val if v_val is not None else dummy,
            v_scales if v_scales is not None else dummy,
            step,
            scratch,
        )
        self.keys, self.first = keys, first
        self.ints = (n, (n + 1) // 2, *keys, first + INDEX_BIAS)  # sizes and hash keys, before the gradient deltas
        self.tail = (*self.state_tensors, dummy)  # dummy: no bucket table
        self.check_tensors = (scratch, step, skipped, dummy)
        self.bucketable: bool | None = None  # whether it can join a bucket (kernels/bucket.py decides once)
        self.check_launches: dict = {}  # resolved direct launches by gradient variant (launch_remembered)
        self.update_launches: dict = {}

    def launch(
        self,
        grad: torch.Tensor,
        accum: torch.Tensor | None,
        scalars: tuple[tuple, tuple],
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """Update from ``grad`` (+ ``accum``); ``grad_scale``: an fp32 0-d device tensor the gradients
        are multiplied by first (clipping), or None. A coefficient is the finite check: NaN skips the
        update, and the gradients are not read to find out (``fusedopt.gradients`` makes it NaN
        exactly where their norm is not finite)."""
        args, check_args = scalars
        has_accum, scaled = accum is not None, grad_scale is not None
        # all the launch key can vary in from step to step: the gradients' dtypes and alignment
        variant = (grad.dtype, not grad.data_ptr() & 15, scaled)
        if has_accum:
            variant += (accum.dtype, not accum.data_ptr() & 15)
        scale = grad_scale if scaled else self.dummy
        launch_remembered(
            _launch_check,
            self.check_launches,
            variant,
            1 if scaled else self.check_programs,
            (grad, accum if has_accum else grad, *self.check_tensors, scale, self.n, *NO_GRAD_DELTAS, *check_args),
            _check_config(has_accum, self.bias_corrections, False, scaled),
        )
        if self.n == 0:
            return
        runtime_args = (
            *self.head, grad, accum if has_accum else self.dummy, *self.tail, *self.ints, *NO_GRAD_DELTAS, *args
        )  # fmt: skip
        config = self.configs[has_accum]
        launch_remembered(
            _launch_update, self.update_launches, variant, self.programs, runtime_args,
            scaled_config(config) if scaled else config,
        )  # fmt: skip


UPDATE_SCALARS = (
    "lr", "beta1", "beta2", "eps", "decay", "weight_decay", "lerp_weight", "one_minus_beta2",
    "v_decay", "v_decay_root",
)  # fmt: skip
_UPDATE_DEFAULTS = dict(
    beta1=0.0, beta2=0.0, eps=0.0, decay=1.0, weight_decay=0.0, lerp_weight=0.0, one_minus_beta2=0.0
)


def pack_scalars(named: dict) -> tuple[tuple, tuple]:
    """The runtime scalars of the update and of the check kernel, in signature order, from an
    algorithm's ``kernel_scalars`` (names of ``UPDATE_SCALARS``, missing ones at their neutral value,
    ``bias_correction_betas`` for the check kernel, and ``moment_decays``: the EMA decay of each moment
    in slot order, as ``ema_decays`` gives them: the kernel takes the second moment's). All floats: a
    Python int would be typed int32."""
    unknown = set(named) - set(UPDATE_SCALARS) - {"bias_correction_betas", "moment_decays"}
    if unknown:
        raise ValueError(f"kernel scalars the fused kernel does not take: {sorted(unknown)}")
    values = {**_UPDATE_DEFAULTS, **named}
    # the square root in fp64 before the one rounding to fp32, as the reference's math.sqrt
    decay = (*named.get("moment_decays", ()), 0.0, 0.0)[1]
    values["v_decay"], values["v_decay_root"] = decay, math.sqrt(decay) if decay >= 0 else 0.0
    beta1, beta2 = named.get("bias_correction_betas", (0.5, 0.5))  # 0.5: any valid value, unused
    check = (named["lr"], *_split_log2("log2_beta1", beta1).values(), *_split_log2("log2_beta2", beta2).values())
    return tuple(float(values[name]) for name in UPDATE_SCALARS), tuple(float(x) for x in check)


@functools.lru_cache(maxsize=16)
def _check_config(has_accum: bool, bias_corrections: bool, bucket: bool, scale_grad: bool = False) -> LaunchConfig:
    constexprs = dict(
        HAS_ACCUM=has_accum,
        BIAS_CORRECTIONS=bias_corrections,
        TILE=CHECK_TILE,
        TILES=CHECK_TILES,
        BUCKET=bucket,
        SCALE_GRAD=scale_grad,
    )
    return LaunchConfig(constexprs, {})


@functools.lru_cache(maxsize=256)
def scaled_config(config: LaunchConfig) -> LaunchConfig:
    """The variant of an update configuration that multiplies the gradients by a coefficient."""
    return LaunchConfig({**config.constexprs, "SCALE_GRAD": True}, config.options)


@functools.lru_cache(maxsize=256)
def bucket_config(config: LaunchConfig) -> LaunchConfig:
    """The bucketed variant of a single-parameter update configuration."""
    return LaunchConfig({**config.constexprs, "BUCKET": True}, config.options)


def _tile(m_fmt: KernelFormat, v_fmt: KernelFormat, corrected: bool, fp32_param: bool) -> tuple[int, int, int | None]:
    """(elements, warps, registers per thread: None for the compiler's choice) of one update program for these
    moments (``corrected``: the parameter has a master correction). Any multiple of the moments' blocks stores the
    same bits: the tile is a speed choice."""
    if Family.ROOT_GRID in (m_fmt.family, v_fmt.family) or Family.NORMALISED in (m_fmt.family, v_fmt.family):
        # (an fp32 parameter, with IEEE arithmetic, keeps the tile measured with a correction)
        if corrected or fp32_param:
            return (*ROOT_GRID_TILE, None)
        return (*ROOT_GRID_UNCORRECTED_TILE, ROOT_GRID_UNCORRECTED_MAX_REGISTERS)
    if corrected and any(f.family == Family.BLOCK and f.bits == 4 for f in (m_fmt, v_fmt)):
        return (*NIBBLE_MASTER_TILE, None)
    return BLOCK, NUM_WARPS, None


def _tile_row(m_fmt: KernelFormat, v_fmt: KernelFormat) -> int:
    """The tile's row length: the moments' quantisation block. A root-grid or normalised moment's block
    may divide it instead (their twins view the tile in rows of their own block)."""
    formats = [f for f in (m_fmt, v_fmt) if f.family not in (Family.NONE, Family.FP32, Family.BF16)]
    if not formats:
        return 32  # unquantised moments: any tile row length works
    row = max(f.block for f in formats)
    for f in formats:
        viewed = f.family in (Family.NORMALISED, Family.ROOT_GRID) and row % f.block == 0
        if f.block != row and not viewed:
            blocks = sorted({g.block for g in formats})
            raise ValueError(f"both moments must use one quantisation block size, got {blocks}")
    return row


def _needs_ieee_denominator(dtype, corr_bits: int, m_fmt: KernelFormat, v_fmt: KernelFormat) -> bool:
    """Whether AdamW's square root and division stay IEEE under ``APPROXIMATE_DENOMINATOR``: with fp32 moments
    (torch.optim.AdamW's results), an fp32 parameter or master (bf16/fp16 + int16), whose grid resolves the
    approximations' 2 ulp of an update, and a root-grid v unless ``APPROXIMATE_ROOT_GRID``."""
    fp32_moments = m_fmt.family == Family.FP32 and v_fmt.family == Family.FP32
    root_grid = v_fmt.family == Family.ROOT_GRID and not APPROXIMATE_ROOT_GRID
    return fp32_moments or dtype == torch.float32 or corr_bits == 16 or root_grid


@functools.lru_cache(maxsize=1024)
def _update_config(
    algo, dtype, corr_bits, param_own_draw, has_accum, maximize, nesterov, m_fmt, v_fmt, block, num_warps, maxnreg,
    index_64, ieee_denominator, approximate_division,
) -> LaunchConfig:  # fmt: skip
    """The compile-time switches of one update configuration (cached: launches happen per parameter)."""
    qblock = _tile_row(m_fmt, v_fmt)
    constexprs = dict(
        ALGO=algo,
        MASTER=0 if dtype == torch.float32 else (1 if corr_bits == 0 else 2),
        PARAM_BF16=dtype == torch.bfloat16,
        CORR_BITS=corr_bits,
        STOCHASTIC_MASTER=not (dtype == torch.bfloat16 and corr_bits == 16),
        PARAM_OWN_DRAW=param_own_draw,
        HAS_ACCUM=has_accum,
        MAXIMIZE=maximize,
        NESTEROV=nesterov,
        **_moment_args("M", m_fmt),
        **_moment_args("V", v_fmt),
        M_CLIP=m_fmt.clip,
        NB=block // qblock,
        QBLOCK=qblock,
        INDEX_64=index_64,
        BUCKET=False,
        SCALE_GRAD=False,
        IEEE_DENOMINATOR=ieee_denominator,
        APPROXIMATE_DIV=approximate_division and not ieee_denominator,
    )
    options = dict(
        num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
        enable_fp_fusion=False,  # the reference rounds every operation; fma only where torch uses one
    )
    return LaunchConfig(constexprs, options)
