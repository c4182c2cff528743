"""Adafactor's kernels: reductions over rows and columns, then the update (``fusedopt.adafactor``).

A parameter is viewed as ``[B, R, C]`` (B the product of its leading dimensions, R and C its last
two); one with fewer than two dimensions as ``[1, 1, N]`` with an element-wise second moment.
One update is six launches on the parameter's stream (ten with CAME), all on the device (no host sync); the
per-parameter workspace (row and column sums, partial sums) is allocated once, at the first update:

1. ``_rows_kernel`` (programs over row blocks, each looping over the columns): per row, the sum
   of g**2 and of p**2 (the master weight: its RMS sets the step size), and whether every gradient
   element is finite (an integer ``atomic_max`` into the scratch flag: deterministic).
2. ``_cols_kernel`` (factored only; programs over column blocks and spans of ``SPLIT_ROWS`` rows):
   per column and span, the sum of g**2, added up in span order by (3). Every sum is made in a
   fixed order: no float atomics, so ``fused=True`` and ``fused=False`` give the same bits.
3. ``_factors_kernel`` (per slice b, one program for the rows and one per chunk of columns): the new
   row and column statistics (lerp towards the means with weight ``t**beta2_decay``, committed only
   for a finite gradient) and the slice's row mean; its program 0 also computes the step size
   ``alpha = max(eps2, RMS(p)) * min(lr, 1/sqrt(t))``.
4. ``_usq_kernel`` (programs over element tiles): ``u = g / sqrt(max(v, eps1**2))`` with
   ``v = row * col / max(row mean, eps1)`` (or the element-wise moment), and each tile's sum of u**2.
5. ``_norm_kernel`` (one program): RMS(u) -> the clipping scale, Fira's limiter on the norm, the
   step count (``step += ok``, ``skipped += !ok``) and the status the update reads.
6. CAME only (``beta3``, factored tensors): ``_came_res_kernel`` writes the residuals
   ``(u_hat - m)**2 + came_eps`` (m the new first moment) to a transient fp32 buffer, which
   ``_sum_rows_kernel`` and ``_cols_kernel`` reduce and ``_factors_kernel`` turns into the new
   confidence statistics, as for the second moment.
7. ``_apply_kernel`` (programs over element tiles, as ``kernels/update.py``): recomputes ``u``,
   scales it, updates the first moment (decode/encode by ``kernels/moments.py``), divides it by
   the confidence (CAME) and writes the master weight (``kernels/master.py``) with the shared
   stochastic-rounding hash.

Recomputing ``u`` in (7) costs one more read of the gradient and the statistics but no
parameter-sized buffer (CAME's residuals excepted: their row and column sums need them twice).
"""

import functools

import torch
import triton
import triton.language as tl

from fusedopt import rng
from fusedopt.codecs.base import NO_MOMENT, Family
from fusedopt.kernels.hashing import step_hash, tile_bits
from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig, launch_remembered
from fusedopt.kernels.master import load_master, store_master
from fusedopt.kernels.moments import commit_mask, load_moment, store_moment, tile_offsets
from fusedopt.kernels.update import _moment_args
from fusedopt.master import MASTER_CORRECTION

# int32 words of the scratch buffer: [0] non-finite flag, [2] status (non-zero: skip the update),
# [3] alpha, [4] the clipping scale, [5] 1 - beta2_t (fp32 bit patterns)
SCRATCH_WORDS = 8
BLOCK = 1024  # elements per program of the element-wise kernels (a multiple of every quantisation block)
NUM_WARPS = 4
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal
USQ_WARPS = 2  # _usq_kernel's: a program's fixed work per thread (its rows, its sum) over 16 elements, not 8
REDUCE_TILE = 2048  # elements of a reduction program's tile
FACTOR_CHUNK = 1024  # rows or columns of one chunk of _factors_kernel
SPLIT_ROWS = 512  # rows of one column-sum program (more programs for tall matrices; partial sums in order)
_NONE = tl.constexpr(Family.NONE)
SCALARS = ("lr", "beta2_decay", "eps1", "eps2", "d", "decay", "beta1", "growth_limit", "beta3", "came_eps")


@triton.jit
def _f32(x):
    return tl.cast(x, tl.float32)


@triton.jit
def _lerp(a, b, w):
    """torch.lerp(a, b, w): a + w * (b - a) for w < 0.5, else b - (b - a) * (1 - w)."""
    return tl.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))


@triton.jit
def _one_minus_beta2(t, beta2_decay):
    """t**beta2_decay for the step count t (>= 1)."""
    return tl.exp2(tl.log2(tl.maximum(t, 1.0)) * _f32(beta2_decay))


@triton.jit
def _load_grad(grad_ptr, accum_ptr, offs, mask, HAS_ACCUM: tl.constexpr):
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ACCUM:
        g += tl.load(accum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return g


@triton.jit
def _rows_kernel(
    grad_ptr,
    accum_ptr,
    param_ptr,
    corr_ptr,
    rowsq_ptr,  # out: per row, sum of g**2
    rowp_ptr,  # out: per row, sum of p**2
    scratch_ptr,
    n_rows,
    n_cols,
    HAS_ACCUM: tl.constexpr,
    MASTER: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    CORR_BITS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
    row_mask = rows < n_rows
    gsq = tl.zeros([BR, BC], tl.float32)
    psq = tl.zeros([BR, BC], tl.float32)
    poison = tl.zeros([BR, BC], tl.float32)
    for c0 in range(0, n_cols, BC):
        cols = c0 + tl.arange(0, BC)
        offs = rows[:, None] * n_cols + cols[None, :]
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        g = _load_grad(grad_ptr, accum_ptr, offs, mask, HAS_ACCUM)
        p = load_master(param_ptr, corr_ptr, offs, mask, MASTER, PARAM_BF16, CORR_BITS)
        gsq += g * g
        psq += p * p
        poison += g * 0.0  # NaN for an inf or a NaN
    tl.store(rowsq_ptr + rows, tl.sum(gsq, axis=1), mask=row_mask)
    tl.store(rowp_ptr + rows, tl.sum(psq, axis=1), mask=row_mask)
    bad = tl.max((poison != poison).to(tl.int32), axis=1)
    bad = tl.max(bad, axis=0)
    tl.atomic_max(scratch_ptr, bad, mask=bad > 0)


@triton.jit
def _sum_rows_kernel(x_ptr, out_ptr, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Per row, the sum of an fp32 buffer (CAME's residuals), in column order."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
    row_mask = rows < n_rows
    acc = tl.zeros([BR, BC], tl.float32)
    for c0 in range(0, n_cols, BC):
        cols = c0 + tl.arange(0, BC)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        acc += tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _cols_kernel(
    grad_ptr,
    accum_ptr,
    colsq_ptr,  # out: [B, splits, C] partial column sums of g**2
    n_rows,
    n_cols,
    n_col_blocks,
    n_splits,
    HAS_ACCUM: tl.constexpr,
    SQUARE: tl.constexpr,  # sums of x**2 (the gradient), else of x (CAME's residuals)
    SPLIT: tl.constexpr,  # rows per program (a multiple of BR)
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    pid = tl.program_id(0)  # (slice, column block, span of rows), the span fastest
    split = pid % n_splits
    col_block = (pid // n_splits) % n_col_blocks
    b = (pid // (n_splits * n_col_blocks)).to(tl.int64)
    cols = col_block * BC + tl.arange(0, BC)
    col_mask = cols < n_cols
    acc = tl.zeros([BR, BC], tl.float32)
    base = b * n_rows * n_cols
    for r0 in range(0, SPLIT, BR):
        rows = split * SPLIT + r0 + tl.arange(0, BR)
        offs = base + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        g = _load_grad(grad_ptr, accum_ptr, offs, mask, HAS_ACCUM)
        if SQUARE:
            acc += g * g
        else:
            acc += g
    out = (b * n_splits + split) * n_cols + cols
    tl.store(colsq_ptr + out, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def _factors_kernel(
    row_ptr,  # state row_var [B * R]
    col_ptr,  # state col_var [B * C]
    rowsq_ptr,
    colsq_ptr,
    rowp_ptr,
    rowmean_ptr,  # out: per slice, the mean of the new row statistic
    step_ptr,
    scratch_ptr,
    n_rows,
    n_cols,
    n_all_rows,  # B * R: the rows whose p**2 sums program 0 adds
    n_elements,
    n_splits,  # partial column sums per column (_cols_kernel's row splits)
    n_col_chunks,  # programs per slice: one for the rows, then one per CHUNK columns
    lr,
    beta2_decay,
    eps2,
    came_weight,  # CAME_STATS: 1 - beta3
    FACTORED: tl.constexpr,
    CAME_STATS: tl.constexpr,  # CAME's confidence statistics (after _norm_kernel), not the second moment
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // (1 + n_col_chunks)).to(tl.int64)
    part = pid % (1 + n_col_chunks)  # 0: the slice's rows; k > 0: its columns' k-th chunk
    if CAME_STATS:
        flag = tl.load(scratch_ptr + 2)  # _norm_kernel moved the flag to the status word
    else:
        flag = tl.load(scratch_ptr)
    ok = flag == 0
    okt = (tl.zeros([CHUNK], tl.int32) + flag) == 0  # a tile: the interpreter takes no scalar mask
    if CAME_STATS:
        t = tl.load(step_ptr)  # unused
        w = _f32(came_weight)
    else:
        t = tl.load(step_ptr) + ok.to(tl.float32)
        w = _one_minus_beta2(t, beta2_decay)
    if FACTORED:
        if part == 0:
            total = tl.zeros([CHUNK], tl.float32)
            for r0 in range(0, n_rows, CHUNK):
                idx = r0 + tl.arange(0, CHUNK)
                mask = idx < n_rows
                old = tl.load(row_ptr + b * n_rows + idx, mask=mask, other=0.0)
                mean = tl.load(rowsq_ptr + b * n_rows + idx, mask=mask, other=0.0) / (n_cols * 1.0)
                new = _lerp(old, mean, w)
                total += tl.where(mask, new, 0.0)
                tl.store(row_ptr + b * n_rows + idx, new, mask=mask & okt)
            tl.store(rowmean_ptr + b, tl.sum(total, axis=0) / (n_rows * 1.0))
        else:  # the columns, a chunk per program: their partial sums are the longest loop
            idx = (part - 1) * CHUNK + tl.arange(0, CHUNK)
            mask = idx < n_cols
            old = tl.load(col_ptr + b * n_cols + idx, mask=mask, other=0.0)
            total_sq = tl.zeros([CHUNK], tl.float32)
            for s in range(0, n_splits):  # in order: deterministic
                total_sq += tl.load(colsq_ptr + (b * n_splits + s) * n_cols + idx, mask=mask, other=0.0)
            mean = total_sq / (n_rows * 1.0)
            tl.store(col_ptr + b * n_cols + idx, _lerp(old, mean, w), mask=mask & okt)
    if not CAME_STATS:  # nested, not `and`: a constexpr and a runtime condition
        if pid == 0:
            acc = tl.zeros([CHUNK], tl.float32)
            for r0 in range(0, n_all_rows, CHUNK):
                idx = r0 + tl.arange(0, CHUNK)
                acc += tl.load(rowp_ptr + idx, mask=idx < n_all_rows, other=0.0)
            rms_p = tl.sqrt_rn(tl.sum(acc, axis=0) / (n_elements * 1.0))
            rho = tl.minimum(_f32(lr), 1.0 / tl.sqrt_rn(tl.maximum(t, 1.0)))
            alpha = tl.maximum(rms_p, _f32(eps2)) * rho
            tl.store(scratch_ptr + 3, alpha.to(tl.int32, bitcast=True))
            tl.store(scratch_ptr + 5, w.to(tl.int32, bitcast=True))


@triton.jit
def _quotient(x, d, inv):
    """x / d rounded as an IEEE division rounds it, from ``inv`` = 1/d (correctly rounded): the
    product, then one correction by its exact residual (Markstein); the product where it overflowed.
    Needs 1/d finite: d, a row mean floored at eps1, normal. A subnormal row mean (eps1 below 1.2e-38)
    means subnormal statistics whose product underflows: v = 0 there, and torch's u = g * rsqrt(0) too."""
    q = x * inv
    fixed = tl.fma(tl.fma(-q, d, x), inv, q)
    return tl.where(tl.abs(q) < float("inf"), fixed, q)


@triton.jit
def _rsqrt(x, maybe_subnormal):
    """1/sqrt(x), approximate on the GPU (as torch's CUDA rsqrt). The hardware's flushes a subnormal
    input to zero: where ``maybe_subnormal`` (a scalar: x's floor is below fp32's smallest normal, as for
    an eps1 under 1e-19) such an input is scaled by 2**64 first and its result by 2**32."""
    if maybe_subnormal:
        tiny = x < _FP32_TINY
        r = tl.rsqrt(tl.where(tiny, x * 18446744073709551616.0, x)) * tl.where(tiny, 4294967296.0, 1.0)
    else:
        r = tl.rsqrt(x)
    return r


@triton.jit
def _factors_at(
    offs, start, mask, row_ptr, col_ptr, rowmean_ptr, n_elements, n_rows, n_cols, floor,
    WIDE: tl.constexpr, SLICED: tl.constexpr,
):  # fmt: skip
    """Per element, the factored estimate ``row * col / max(its slice's row mean, floor)`` (finite where
    masked), rounded as the reference's division.

    ``offs``: the tile's elements, ``start`` its first (the tile is consecutive elements). ``WIDE``: a
    row has at least as many elements as the tile, so the tile spans at most two rows, whose statistics
    and reciprocals are the program's scalars (the quotient by ``_quotient``). ``SLICED``:
    the parameter has more than two dimensions (several slices of rows)."""
    if WIDE:
        row0 = start // n_cols
        col = (start - row0 * n_cols).to(tl.int32) + (offs - start).to(tl.int32)
        over = col >= n_cols  # the element is in the tile's second row
        col = tl.where(over, col - n_cols, col)
        row1 = row0 + ((row0 + 1) * n_cols < n_elements).to(tl.int64)  # row0 again where it is the last
        if SLICED:
            slice0 = row0 // n_rows
            slice1 = slice0 + (row1 - slice0 * n_rows == n_rows).to(tl.int64)
        else:
            slice0 = row0 * 0
            slice1 = slice0
        d0 = tl.maximum(tl.load(rowmean_ptr + slice0), floor)
        d1 = tl.maximum(tl.load(rowmean_ptr + slice1), floor)
        r = tl.where(over, tl.load(row_ptr + row1), tl.load(row_ptr + row0))
        d = tl.where(over, d1, d0)
        inv = tl.where(over, tl.div_rn(1.0, d1), tl.div_rn(1.0, d0))
        c = tl.load(col_ptr + tl.where(over, slice1 * n_cols, slice0 * n_cols) + col, mask=mask, other=1.0)
        v = _quotient(r * c, d, inv)
    else:
        row_index = offs // n_cols
        slice_index = row_index // n_rows
        col_index = slice_index * n_cols + offs % n_cols
        r = tl.load(row_ptr + row_index, mask=mask, other=1.0)
        c = tl.load(col_ptr + col_index, mask=mask, other=1.0)
        v = tl.div_rn(r * c, tl.maximum(tl.load(rowmean_ptr + slice_index, mask=mask, other=1.0), floor))
    return v


@triton.jit
def _u(
    g, offs, start, mask, row_ptr, col_ptr, rowmean_ptr, v_ptr, w, eps1, n_elements, n_rows, n_cols,
    FACTORED: tl.constexpr, WIDE: tl.constexpr, SLICED: tl.constexpr,
):  # fmt: skip
    """u = g * rsqrt(max(v, eps1**2)) (torch's form) and the new element-wise moment (unfactored; else v)."""
    if FACTORED:
        v = _factors_at(
            offs, start, mask, row_ptr, col_ptr, rowmean_ptr, n_elements, n_rows, n_cols, eps1, WIDE, SLICED
        )  # fmt: skip
    else:
        v = _lerp(tl.load(v_ptr + offs, mask=mask, other=0.0), g * g, w)
    floor = eps1 * eps1
    u = g * _rsqrt(tl.maximum(v, floor), floor < _FP32_TINY)
    return u, v


@triton.jit
def _usq_kernel(
    grad_ptr,
    accum_ptr,
    row_ptr,
    col_ptr,
    rowmean_ptr,
    v_ptr,
    part_ptr,  # out: per program, the sum of u**2
    scratch_ptr,
    n_elements,
    n_rows,
    n_cols,
    eps1,
    HAS_ACCUM: tl.constexpr,
    FACTORED: tl.constexpr,
    WIDE: tl.constexpr,
    SLICED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK_SIZE
    offs = start + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    g = _load_grad(grad_ptr, accum_ptr, offs, mask, HAS_ACCUM)
    w = tl.load(scratch_ptr + 5).to(tl.float32, bitcast=True)
    u, _ = _u(
        g, offs, start, mask, row_ptr, col_ptr, rowmean_ptr, v_ptr, w, _f32(eps1), n_elements, n_rows, n_cols,
        FACTORED, WIDE, SLICED,
    )  # fmt: skip
    tl.store(part_ptr + pid, tl.sum(tl.where(mask, u * u, 0.0), axis=0))


@triton.jit
def _norm_kernel(
    part_ptr,
    norm_ptr,  # state update_norm (FIRA)
    step_ptr,
    skipped_ptr,
    scratch_ptr,
    n_parts,
    n_elements,
    d,
    growth_limit,
    FIRA: tl.constexpr,
    CHUNK: tl.constexpr,
):
    acc = tl.zeros([CHUNK], tl.float32)
    # one program: bound by load latency, so eight chunks' loads are issued before the first add (the
    # adds stay chunk by chunk, in order: the sum of a rolled loop, bit for bit)
    for i0 in range(0, n_parts, 8 * CHUNK):
        idx = i0 + tl.arange(0, CHUNK)
        x0 = tl.load(part_ptr + idx, mask=idx < n_parts, other=0.0)
        x1 = tl.load(part_ptr + idx + CHUNK, mask=idx + CHUNK < n_parts, other=0.0)
        x2 = tl.load(part_ptr + idx + 2 * CHUNK, mask=idx + 2 * CHUNK < n_parts, other=0.0)
        x3 = tl.load(part_ptr + idx + 3 * CHUNK, mask=idx + 3 * CHUNK < n_parts, other=0.0)
        x4 = tl.load(part_ptr + idx + 4 * CHUNK, mask=idx + 4 * CHUNK < n_parts, other=0.0)
        x5 = tl.load(part_ptr + idx + 5 * CHUNK, mask=idx + 5 * CHUNK < n_parts, other=0.0)
        x6 = tl.load(part_ptr + idx + 6 * CHUNK, mask=idx + 6 * CHUNK < n_parts, other=0.0)
        x7 = tl.load(part_ptr + idx + 7 * CHUNK, mask=idx + 7 * CHUNK < n_parts, other=0.0)
        acc = (((((((acc + x0) + x1) + x2) + x3) + x4) + x5) + x6) + x7
    total = tl.sum(acc, axis=0)
    rms_u = tl.sqrt_rn(total / (n_elements * 1.0))
    scale = 1.0 / tl.maximum(rms_u / _f32(d), 1.0)
    flag = tl.load(scratch_ptr)
    ok = flag == 0
    if FIRA:
        norm = tl.sqrt_rn(total) * scale
        prev = tl.load(norm_ptr)
        limit = _f32(growth_limit) * prev
        limited = (prev > 0.0) & (norm > limit)
        scale = tl.where(limited, scale * (limit / norm), scale)
        tl.store(norm_ptr, tl.where(ok, tl.where(limited, limit, norm), prev))
    tl.store(scratch_ptr + 4, scale.to(tl.int32, bitcast=True))
    tl.store(scratch_ptr + 2, flag)
    tl.store(scratch_ptr, 0)
    tl.store(step_ptr, tl.load(step_ptr) + ok.to(tl.float32))
    tl.atomic_add(skipped_ptr, flag.to(tl.int64), mask=flag != 0)


@triton.jit
def _came_res_kernel(
    grad_ptr,
    accum_ptr,
    m_ptr,
    m_scale_ptr,
    row_ptr,
    col_ptr,
    rowmean_ptr,
    res_ptr,  # out: (u_hat - m)**2 + came_eps per element (fp32)
    scratch_ptr,
    n_elements,
    n_pairs,
    n_rows,
    n_cols,
    eps1,
    beta1,
    came_eps,
    HAS_ACCUM: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    M_FAMILY: tl.constexpr,  # fusedopt.codecs.base.Family
    M_BITS: tl.constexpr,
    M_SIGNED: tl.constexpr,
    M_POWER: tl.constexpr,
    M_QMAX: tl.constexpr,
    M_K: tl.constexpr,
    M_MIN_E: tl.constexpr,
    NB: tl.constexpr,
    QBLOCK: tl.constexpr,
    WIDE: tl.constexpr,
    SLICED: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * (NB * QBLOCK)
    offs = tile_offsets(start, NB, QBLOCK)
    mask = offs < n_elements
    g = _load_grad(grad_ptr, accum_ptr, offs, mask, HAS_ACCUM)
    if MAXIMIZE:
        g = -g
    scale = tl.load(scratch_ptr + 4).to(tl.float32, bitcast=True)
    w = tl.load(scratch_ptr + 5).to(tl.float32, bitcast=True)
    u, _ = _u(
        g, offs, start, mask, row_ptr, col_ptr, rowmean_ptr, row_ptr, w, _f32(eps1), n_elements, n_rows, n_cols,
        True, WIDE, SLICED,
    )  # fmt: skip
    u_hat = u * scale
    m = load_moment(
        m_ptr, m_scale_ptr, start, n_elements, n_pairs, M_FAMILY, M_BITS, M_SIGNED, M_POWER, M_QMAX, M_K, M_MIN_E,
        NB, QBLOCK,
    )  # fmt: skip
    m = _lerp(m, u_hat, 1.0 - _f32(beta1))
    d = u_hat - m
    tl.store(res_ptr + offs, d * d + _f32(came_eps), mask=mask)


@triton.jit(do_not_specialize=["key_shared", "key_param"])
def _apply_kernel(
    param_ptr,
    corr_ptr,
    grad_ptr,
    accum_ptr,
    m_ptr,
    m_scale_ptr,
    row_ptr,
    col_ptr,
    rowmean_ptr,
    v_ptr,
    res_row_ptr,  # CAME: the confidence statistics and their row means
    res_col_ptr,
    res_rowmean_ptr,
    step_ptr,
    scratch_ptr,
    n_elements,
    n_pairs,
    n_rows,
    n_cols,
    key_shared,
    key_param,
    lr,
    eps1,
    decay,  # 1 - lr * weight_decay
    beta1,
    MASTER: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    CORR_BITS: tl.constexpr,
    STOCHASTIC_MASTER: tl.constexpr,
    PARAM_OWN_DRAW: tl.constexpr,
    HAS_ACCUM: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    FACTORED: tl.constexpr,
    CAME: tl.constexpr,
    M_FAMILY: tl.constexpr,  # fusedopt.codecs.base.Family
    M_BITS: tl.constexpr,
    M_SIGNED: tl.constexpr,
    M_POWER: tl.constexpr,
    M_QMAX: tl.constexpr,
    M_K: tl.constexpr,
    M_MIN_E: tl.constexpr,
    M_THR: tl.constexpr,
    M_TOP: tl.constexpr,
    NB: tl.constexpr,
    QBLOCK: tl.constexpr,
    WIDE: tl.constexpr,
    SLICED: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * (NB * QBLOCK)
    offs = tile_offsets(start, NB, QBLOCK)
    mask = offs < n_elements
    status = tl.load(scratch_ptr + 2)
    commit = mask & commit_mask(status, NB, QBLOCK)
    g = _load_grad(grad_ptr, accum_ptr, offs, mask, HAS_ACCUM)
    if MAXIMIZE:
        g = -g
    alpha = tl.load(scratch_ptr + 3).to(tl.float32, bitcast=True)
    scale = tl.load(scratch_ptr + 4).to(tl.float32, bitcast=True)
    w = tl.load(scratch_ptr + 5).to(tl.float32, bitcast=True)
    u, v = _u(
        g, offs, start, mask, row_ptr, col_ptr, rowmean_ptr, v_ptr, w, _f32(eps1), n_elements, n_rows, n_cols,
        FACTORED, WIDE, SLICED,
    )  # fmt: skip
    if not FACTORED:
        tl.store(v_ptr + offs, v, mask=commit)
    update = u * scale
    step = tl.load(step_ptr)
    shared = tile_bits(step_hash(key_shared, step), start, NB, QBLOCK)
    if M_FAMILY != _NONE:
        m = load_moment(
            m_ptr, m_scale_ptr, start, n_elements, n_pairs, M_FAMILY, M_BITS, M_SIGNED, M_POWER, M_QMAX, M_K, M_MIN_E,
            NB, QBLOCK,
        )  # fmt: skip
        m = _lerp(m, update, 1.0 - _f32(beta1))
        update = m
        if CAME:  # m / sqrt(S), S the factored confidence statistic
            confidence = _factors_at(
                offs, start, mask, res_row_ptr, res_col_ptr, res_rowmean_ptr, n_elements, n_rows, n_cols, 0.0,
                WIDE, SLICED,
            )  # fmt: skip
            update = m * _rsqrt(confidence, True)
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
    p = load_master(param_ptr, corr_ptr, offs, mask, MASTER, PARAM_BF16, CORR_BITS)
    p = p * _f32(decay)
    p = p - update * alpha
    if PARAM_OWN_DRAW:
        param_bits = tile_bits(step_hash(key_param, step), start, NB, QBLOCK)
    else:
        param_bits = shared << 24
    store_master(p, param_bits, param_ptr, corr_ptr, offs, commit, MASTER, PARAM_BF16, CORR_BITS, STOCHASTIC_MASTER)


# --- host side ------------------------------------------------------------------------------------

# Direct launches (kernels/launcher.py): runtime arguments as tensors, then ints, then floats
_ROWS = DirectLauncher(_rows_kernel, tensors=7, ints=2)
_SUM_ROWS = DirectLauncher(_sum_rows_kernel, tensors=2, ints=2)
_COLS = DirectLauncher(_cols_kernel, tensors=3, ints=4)
_FACTORS = DirectLauncher(_factors_kernel, tensors=8, ints=6)
_USQ = DirectLauncher(_usq_kernel, tensors=8, ints=3)
_NORM = DirectLauncher(_norm_kernel, tensors=5, ints=2)
_CAME_RES = DirectLauncher(_came_res_kernel, tensors=9, ints=4)
_APPLY = DirectLauncher(_apply_kernel, tensors=15, ints=6)


def _config(num_warps: int = NUM_WARPS, **constexprs) -> LaunchConfig:
    # no fused multiply-adds the reference does not make (as kernels/update.py)
    return LaunchConfig(constexprs, {"num_warps": num_warps, "enable_fp_fusion": False})


def pack_scalars(named: dict) -> tuple:
    """The kernels' runtime scalars from ``Adafactor.kernel_scalars`` (None: the option is off)."""
    values = dict(named)
    values["decay"] = 1 - values["lr"] * values["weight_decay"]  # in fp64, as the reference
    out = tuple(0.0 if values[k] is None else float(values[k]) for k in SCALARS)
    return out


def unsupported(algorithm, job) -> str | None:
    """What these kernels cannot take (``fusedopt.dispatch`` checks devices and layout)."""
    if job.param.numel() == 0:
        return "an empty parameter"
    if job.first != 0:
        return "a shard of a parameter (its row and column statistics need the whole tensor)"
    m = job.codecs.get("exp_avg")
    plain = (Family.FP32, Family.BF16, Family.BLOCK)
    if m is not None and (m.kernel_format is None or m.kernel_format.family not in plain):
        return f"the factored kernels have no branch for the state format {m.name!r} (of 'exp_avg')"
    return None


def _pow2(n: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(1, n)))


@functools.lru_cache(maxsize=256)
def _apply_constexprs(m_fmt, dtype, corr_bits, param_own_draw, factored, came):
    qblock = m_fmt.block if m_fmt.family == Family.BLOCK else 32
    return dict(
        MASTER=0 if dtype == torch.float32 else (1 if corr_bits == 0 else 2),
        PARAM_BF16=dtype == torch.bfloat16,
        CORR_BITS=corr_bits,
        STOCHASTIC_MASTER=not (dtype == torch.bfloat16 and corr_bits == 16),
        PARAM_OWN_DRAW=param_own_draw,
        FACTORED=factored,
        CAME=came,
        **_moment_args("M", m_fmt),
        NB=BLOCK // qblock,
        QBLOCK=qblock,
    )


class PreparedFactored:
    """One parameter's launches: its tensors, shapes, workspace and compile-time switches."""

    bucketable = False  # launched alone (dispatch's buckets are the element-wise kernel's)

    def __init__(self, job, scratch: torch.Tensor):
        p, state = job.param, job.state
        shape = p.shape
        self.factored = len(shape) >= 2
        n = p.numel()
        if self.factored:
            rows, cols = shape[-2], shape[-1]
            slices = n // (rows * cols)
        else:
            rows, cols, slices = 1, n, 1
        self.n, self.rows, self.cols, self.slices = n, rows, cols, slices
        self.param = p
        split = p.dtype != torch.float32 and job.master_weight_bits
        self.corr = state.get(MASTER_CORRECTION) if split else None
        corr_bits = 0 if self.corr is None else (16 if self.corr.dtype == torch.int16 else 8)
        dummy = p
        self.dummy = dummy
        m_codec = job.codecs.get("exp_avg")
        self.m_fmt = m_codec.kernel_format if m_codec is not None else NO_MOMENT
        if m_codec is None:
            self.m, self.m_scales = dummy, dummy
        else:
            self.m = state["exp_avg"] if self.m_fmt.family in (Family.FP32, Family.BF16) else state["exp_avg.codes"]
            self.m_scales = state.get("exp_avg.scales", dummy)
        self.row = state["row_var"] if self.factored else dummy
        self.col = state["col_var"] if self.factored else dummy
        self.v = state["variance"] if not self.factored else dummy
        self.norm = state.get("update_norm", dummy)
        self.came = "exp_avg_res_row" in state  # factored, with beta1 and beta3
        self.res_row, self.res_col = state.get("exp_avg_res_row", dummy), state.get("exp_avg_res_col", dummy)
        self.step, self.scratch, self.skipped = state["step"], scratch, job.skipped
        self.programs = -(-n // BLOCK)
        col_block = _pow2(cols, 64)
        col_rows = max(1, min(_pow2(rows, 1024), REDUCE_TILE // col_block))
        split = max(col_rows, min(SPLIT_ROWS, _pow2(rows, SPLIT_ROWS)))
        self.col_tile = (col_block, col_rows, split)
        self.splits = -(-rows // split)
        ws = [slices * rows, slices * self.splits * cols, slices * rows, slices, self.programs]
        ws += [slices * rows, slices * self.splits * cols, slices] if self.came else [0, 0, 0]
        work = torch.zeros(sum(ws), dtype=torch.float32, device=p.device)
        self.rowsq, self.colsq, self.rowp, self.rowmean, self.parts, *came_work = torch.split(work, ws)
        self.res_rowsum, self.res_colsq, self.res_rowmean = came_work if self.came else (dummy, dummy, dummy)
        self.keys = (
            rng.host_key(job.seed, job.index, rng.STREAM_SHARED),
            rng.host_key(job.seed, job.index, rng.STREAM_PARAM),
        )
        own_draw = not rng.param_shares_draw(p.dtype, job.master_weight_bits)
        self.maximize = bool(job.hyper.get("maximize", False))
        self.master = dict(
            MASTER=0 if p.dtype == torch.float32 else (1 if corr_bits == 0 else 2),
            PARAM_BF16=p.dtype == torch.bfloat16,
            CORR_BITS=corr_bits,
        )
        self.apply = _apply_constexprs(self.m_fmt, p.dtype, corr_bits, own_draw, self.factored, self.came)
        all_rows = slices * rows
        self.row_tile = (_pow2(cols, 256), max(1, min(_pow2(all_rows, 1024), REDUCE_TILE // _pow2(cols, 256))))
        self.row_programs = -(-all_rows // self.row_tile[1])
        self.col_blocks = -(-cols // col_block)
        # _factors_kernel: per slice, a program for the rows and one per FACTOR_CHUNK columns
        self.col_chunks = -(-cols // FACTOR_CHUNK) if self.factored else 0
        self.factor_programs = slices * (1 + self.col_chunks) if self.factored else 1
        # a tile of the element-wise kernels spans at most two rows: no divisions per element
        self.wide = self.factored and cols >= BLOCK
        self.sliced = slices > 1
        self.col_programs = slices * self.col_blocks * self.splits
        self.fira = "update_norm" in state
        self.configs = {False: self._configs(False), True: self._configs(True)}
        self.remembered: dict = {}  # resolved direct launches, by kernel and gradient variant

    def _configs(self, has_accum: bool) -> dict:
        """The compile-time switches of every launch, for gradients with or without an accumulated part."""
        row_bc, row_br = self.row_tile
        col_bc, col_br, split = self.col_tile
        m_args = {k: v for k, v in self.apply.items() if k.startswith("M_") and k not in ("M_THR", "M_TOP")}
        return dict(
            rows=_config(HAS_ACCUM=has_accum, **self.master, BR=row_br, BC=row_bc),
            cols=_config(HAS_ACCUM=has_accum, SQUARE=True, SPLIT=split, BR=col_br, BC=col_bc),
            factors=_config(FACTORED=self.factored, CAME_STATS=False, CHUNK=FACTOR_CHUNK),
            usq=_config(
                USQ_WARPS,
                HAS_ACCUM=has_accum,
                FACTORED=self.factored,
                WIDE=self.wide,
                SLICED=self.sliced,
                BLOCK_SIZE=BLOCK,
            ),
            norm=_config(FIRA=self.fira, CHUNK=1024),
            came_res=_config(
                HAS_ACCUM=has_accum,
                MAXIMIZE=self.maximize,
                **m_args,
                NB=self.apply["NB"],
                QBLOCK=self.apply["QBLOCK"],
                WIDE=self.wide,
                SLICED=self.sliced,
            ),
            sum_rows=_config(BR=row_br, BC=row_bc),
            came_cols=_config(HAS_ACCUM=False, SQUARE=False, SPLIT=split, BR=col_br, BC=col_bc),
            came_factors=_config(FACTORED=True, CAME_STATS=True, CHUNK=FACTOR_CHUNK),
            apply=_config(
                HAS_ACCUM=has_accum,
                MAXIMIZE=self.maximize,
                **self.apply,
                WIDE=self.wide,
                SLICED=self.sliced,
            ),
        )

    def _go(self, name: str, launcher, grid: int, args: tuple, variant) -> None:
        config = self.configs[variant[-1]][name]
        launch_remembered(launcher, self.remembered.setdefault(name, {}), variant, grid, args, config)

    def launch(self, grad: torch.Tensor, accum: torch.Tensor | None, scalars: tuple) -> None:
        lr, beta2_decay, eps1, eps2, d, decay, beta1, growth_limit, beta3, came_eps = scalars[:10]
        has_accum = accum is not None
        acc = accum if has_accum else grad
        # all the launch keys can vary in from step to step: the gradients' dtypes and alignment
        variant = (grad.dtype, not grad.data_ptr() & 15, acc.dtype, not acc.data_ptr() & 15, has_accum)
        corr = self.corr if self.corr is not None else self.dummy
        all_rows, n, rows, cols = self.slices * self.rows, self.n, self.rows, self.cols
        go = self._go
        args = (grad, acc, self.param, corr, self.rowsq, self.rowp, self.scratch, all_rows, cols)
        go("rows", _ROWS, self.row_programs, args, variant)
        if self.factored:
            args = (grad, acc, self.colsq, rows, cols, self.col_blocks, self.splits)
            go("cols", _COLS, self.col_programs, args, variant)
        args = (self.row, self.col, self.rowsq, self.colsq, self.rowp, self.rowmean, self.step, self.scratch)
        args += (rows, cols, all_rows, n, self.splits, self.col_chunks, lr, beta2_decay, eps2, 0.0)
        go("factors", _FACTORS, self.factor_programs, args, variant)
        args = (grad, acc, self.row, self.col, self.rowmean, self.v, self.parts, self.scratch, n, rows, cols, eps1)
        go("usq", _USQ, self.programs, args, variant)
        args = (self.parts, self.norm, self.step, self.skipped, self.scratch, self.programs, n, d, growth_limit)
        go("norm", _NORM, 1, args, variant)
        if self.came:
            # CAME's factored confidence statistics: the residuals (u_hat - m)**2 + came_eps into a
            # transient fp32 buffer (4 bytes per element of this parameter, freed after the update),
            # their row and column sums, then the EMAs (committed only for a finite gradient)
            res = torch.empty(n, dtype=torch.float32, device=self.param.device)
            args = (grad, acc, self.m, self.m_scales, self.row, self.col, self.rowmean, res, self.scratch)
            args += (n, (n + 1) // 2, rows, cols, eps1, beta1, came_eps)
            go("came_res", _CAME_RES, self.programs, args, variant)
            go("sum_rows", _SUM_ROWS, self.row_programs, (res, self.res_rowsum, all_rows, cols), variant)
            args = (res, res, self.res_colsq, rows, cols, self.col_blocks, self.splits)
            go("came_cols", _COLS, self.col_programs, args, variant)
            args = (self.res_row, self.res_col, self.res_rowsum, self.res_colsq, self.res_rowsum, self.res_rowmean)
            args += (self.step, self.scratch, rows, cols, all_rows, n, self.splits, self.col_chunks)
            args += (0.0, 0.0, 0.0, 1.0 - beta3)
            go("came_factors", _FACTORS, self.factor_programs, args, variant)
        args = (self.param, corr, grad, acc, self.m, self.m_scales, self.row, self.col, self.rowmean, self.v)
        args += (self.res_row, self.res_col, self.res_rowmean, self.step, self.scratch)
        args += (n, (n + 1) // 2, rows, cols, *self.keys, lr, eps1, decay, beta1)
        go("apply", _APPLY, self.programs, args, variant)


def launch_job(algorithm, job, scratch: torch.Tensor, scalars: tuple) -> PreparedFactored:
    """Prepare ``job``'s parameter (workspace, switches) and run its first update."""
    prepared = PreparedFactored(job, scratch)
    prepared.launch(job.grad, job.accum, scalars)
    return prepared
