"""Choose the 8- and 4-bit moment formats by measurement; the figures are in docs/codecs.md.

    python benchmarks/codec_choice.py --part roundtrip --device cpu           # ~1 min
    python benchmarks/codec_choice.py --part spread --device cpu              # ~1 min
    python benchmarks/codec_choice.py --part track --track maps --bits 8      # ~3 min on an H200
    python benchmarks/codec_choice.py --part track --track pairs --bits 4     # ~4 min on an H200
    python benchmarks/codec_choice.py --part train --bits 8                   # ~35 s per run and seed
    python benchmarks/codec_choice.py --part train --bits 4 --select "int4 m sq/16, v sq/16"

(``--quick``: a smoke test with a few steps.) The measurements, per candidate (a signed format
for m and a nonnegative one for v; a spec reads ``levels[/block][/fp32]``, block 32 and E8M0
scales by default):

* ``roundtrip``: one encode -> decode of Gaussian, Student-t(3) and lognormal data (v: their
  squares); error of m, and per-element relative error of sqrt(v), the quantity AdamW
  divides by.
* ``spread``: how much real second moments vary inside a block (torch.optim.AdamW on the
  training task below), to place the two synthetic settings of ``track``.
* ``track``: 2400 AdamW moment updates from a synthetic gradient stream (per-element scales
  spread across blocks, or also within them; a quarter of the rows stop receiving gradient
  halfway), each step decode -> EMA -> encode as the optimizer does: the relative error of
  the AdamW update against fp32 moments fed the same gradients. It includes the noise that
  stochastic requantisation accumulates over the EMA's memory.
* ``train``: a byte-level MLP language model on this Python's standard-library source,
  1500 steps of fusedopt.AdamW whose codecs are swapped for the candidate's; held-out loss
  against fp32 state (mean of 2 seeds).

Candidates are ``BlockCodec`` configurations (levels ``q**p`` or minifloat, power-of-two E8M0
block scales) plus the same levels with an fp32 absmax scale per block (bitsandbytes /
torchao style).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
# The candidates exist only in the PyTorch reference (the kernel implements the chosen formats).
os.environ["FUSEDOPT_BACKEND"] = "reference"

import fusedopt  # noqa: E402
from fusedopt import rng  # noqa: E402
from fusedopt.codecs import BF16, FP32  # noqa: E402
from fusedopt.codecs.blockwise import BlockCodec, MinifloatLevels, PowerLevels, _pow2  # noqa: E402
from fusedopt.profile.models import stdlib_source_bytes  # noqa: E402


class FloatLevels:
    """Candidate level map: minifloat with ``ebits`` exponent and ``mbits`` mantissa bits.

    Code q = (E << mbits) | f means f (E = 0, subnormal) or (2**mbits + f) * 2**(E - 1): a
    constant relative step of 2**-mbits over 2**ebits - 1 binades (the OCP MX element formats).
    """

    def __init__(self, ebits: int, mbits: int):
        self.ebits, self.mbits = ebits, mbits
        self.qmax = (1 << (ebits + mbits)) - 1
        self.top = ((2 << mbits) - 1) << ((1 << ebits) - 2)

    def level(self, q):
        big_e = q >> self.mbits
        f = (q & ((1 << self.mbits) - 1)).to(torch.float32)
        return torch.where(big_e == 0, f, (f + (1 << self.mbits)) * _pow2((big_e - 1).clamp(min=0)))

    def quantize(self, t, u):
        m = self.mbits
        pattern = t.view(torch.int32)
        binade = (pattern >> 23) - 127
        normal = t >= (1 << m)
        # Truncating t's mantissa to m bits gives the level below; the step is a power of two.
        lo = torch.where(normal, (pattern & -(1 << (23 - m))).view(torch.float32), t.floor())
        step = torch.where(normal, _pow2((binade - m).clamp(min=0)), 1.0)
        mantissa = (pattern >> (23 - m)) & ((1 << m) - 1)
        q_lo = torch.where(normal, ((binade - m + 1) << m) | mantissa, lo.to(torch.int32))
        return q_lo + (u * step < t - lo).to(torch.int32)

    def __repr__(self):
        return f"E{self.ebits}M{self.mbits}"


class Fp32ScaleCodec(BlockCodec):
    """Same levels, but one fp32 scale per block: the absmax maps exactly onto the top level."""

    scale_dtype = torch.float32
    kernel_format = None  # the kernel reads E8M0 scales only

    def block_scales(self, absmax):
        unit = absmax / self.top
        return torch.where(unit > 0, unit, torch.ones_like(unit))

    def level_units(self, scales):
        return scales, 1.0 / scales

    def __repr__(self):
        return super().__repr__().replace("BlockCodec", "Fp32ScaleCodec")


POWERS = {"lin": 1, "sq": 2, "cube": 3, "pow4": 4}


def levels(name: str, bits: int, signed: bool):
    """'lin' / 'sq' / 'cube' / 'pow4': q**p levels; 'mf': shifted minifloat with 4 mantissa bits
    (the 8-bit default since 2026-11-30); 'E4M3' etc.: minifloat levels."""
    if name in POWERS:
        return PowerLevels((1 << (bits - signed)) - 1, POWERS[name])
    if name == "mf":
        return MinifloatLevels((1 << (bits - signed)) - 1, 4)
    ebits, mbits = int(name[1]), int(name[3])
    assert ebits + mbits == bits - signed, name
    return FloatLevels(ebits, mbits)


def make(bits: int, signed: bool, spec: str, shape: torch.Size):
    """A codec from a spec 'levels[/block][/fp32]', e.g. 'sq', 'lin/64', 'sq/32/fp32'; 'fp32': exact."""
    if spec == "fp32":
        return FP32
    name, *rest = spec.split("/")
    block = int(rest[0]) if rest else 32
    cls = Fp32ScaleCodec if rest[1:] == ["fp32"] else BlockCodec
    return cls(bits, signed, levels(name, bits, signed), block, shape)


def bytes_per_element(bits: int, spec: str) -> float:
    if spec == "fp32":
        return 4.0
    name, *rest = spec.split("/")
    block = int(rest[0]) if rest else 32
    return bits / 8 + (4 if rest[1:] == ["fp32"] else 1) / block


# Level maps at block 32 with E8M0 scales, each moment measured with the other one exact.
MAPS = {
    (8, True): ["lin", "sq", "cube", "E4M3", "E3M4", "E2M5", "mf"],
    (8, False): ["lin", "sq", "cube", "E5M3", "E4M4", "E3M5", "mf"],
    (4, True): ["lin", "sq", "cube", "E2M1"],
    (4, False): ["lin", "sq", "cube", "pow4", "E2M2", "E3M1"],
}
# Then (m spec, v spec) pairs: the best maps, block sizes, fp32 scales (bitsandbytes/torchao-like).
PAIRS = {
    8: [
        ("lin/32/fp32", "lin/32/fp32"),
        ("lin", "lin"),
        ("lin", "sq"),
        ("sq", "sq"),
        ("sq", "cube"),
        ("sq", "E4M4"),
        ("E3M4", "E4M4"),
        ("sq/32/fp32", "sq/32/fp32"),
        ("sq/16", "sq/16"),
        ("sq/64", "sq/64"),
        ("sq/128", "sq/128"),
        ("sq/16", "cube/16"),
        ("mf", "mf"),
        ("mf/16", "mf/16"),
    ],
    4: [
        ("lin/32/fp32", "lin/32/fp32"),
        ("lin", "lin"),
        ("lin", "sq"),
        ("sq", "sq"),
        ("cube", "sq"),
        ("sq", "E3M1"),
        ("sq/32/fp32", "sq/32/fp32"),
        ("sq/8", "sq/8"),
        ("sq/16", "sq/16"),
        ("sq/64", "sq/64"),
    ],
}
# Trained end to end (a subset: the training loss separates less than the tracking error).
TRAINED = {
    8: [
        ("lin/32/fp32", "lin/32/fp32"),
        ("lin", "lin"),
        ("lin", "sq"),
        ("sq", "sq"),
        ("sq", "cube"),
        ("E4M3", "E4M4"),
        ("sq/16", "sq/16"),
        ("mf/16", "mf/16"),
    ],
    4: [
        ("lin/32/fp32", "lin/32/fp32"),
        ("lin", "lin"),
        ("lin", "sq"),
        ("sq", "sq"),
        ("sq/16", "sq/16"),
        ("sq/8", "sq/8"),
    ],
}


def label(bits: int, m: str, v: str) -> str:
    return f"{'bf16' if bits == 16 else f'int{bits}'} m {m}, v {v}"


def bits_fn(key: int, step: int, shape: torch.Size, device):
    step_t = torch.tensor(float(step), device=device)
    return lambda: rng.uniform_bits(key, step_t, shape, device)


# --- round trip ------------------------------------------------------------------------------


def sample(kind: str, shape, gen, device) -> torch.Tensor:
    if kind == "gauss":
        x = torch.randn(shape, generator=gen)
    elif kind == "student-t3":
        x = torch.distributions.StudentT(3.0).sample(shape)  # uses the global RNG (seeded)
    else:  # lognormal magnitudes spanning decades within a block, random signs
        x = torch.exp(2.0 * torch.randn(shape, generator=gen)) * torch.randn(shape, generator=gen).sign()
    return x.to(device)


def roundtrip_specs():
    seen = []
    for (bits, signed), names in MAPS.items():
        seen += [(bits, signed, n) for n in names]
    for bits, pairs in PAIRS.items():
        for m, v in pairs:
            seen += [(bits, True, m), (bits, False, v)]
    return list(dict.fromkeys(seen))


def roundtrip(device) -> list[str]:
    shape = torch.Size([256, 1027])
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    data = [sample(k, shape, gen, device) for k in ("gauss", "student-t3", "lognormal")]
    rows = [
        "| moment format | B/elem | m: rel. RMS err, gauss / t3 / lognorm | m: median per-element rel. err, same |",
        "|---|---|---|---|",
    ]
    vrows = [
        "| moment format | B/elem | sqrt(v): median per-element rel. err, gauss / t3 / lognorm | "
        "sqrt(v) under by > 2x, lognorm |",
        "|---|---|---|---|",
    ]
    for bits, signed, spec in roundtrip_specs():
        codec = make(bits, signed, spec, shape)
        name = f"int{bits} {'m' if signed else 'v'} {spec} | {bytes_per_element(bits, spec):.3f}"
        a, b, bad = [], [], 0.0
        for i, x in enumerate(data):
            if signed:
                xm = codec.decode(codec.encode(x, bits_fn(1, i, shape, device)))
                a.append(((xm - x).norm() / x.norm()).item())
                b.append(((xm - x).abs() / x.abs()).median().item())
            else:
                s = x.abs()  # sqrt(v) for v = x**2
                sv = codec.decode(codec.encode(x * x, bits_fn(2, i, shape, device))).sqrt()
                a.append(((sv - s).abs() / s).median().item())
                bad = (sv < s / 2).float().mean().item()  # AdamW's step for these is more than doubled
        if signed:
            rows.append(f"| {name} | {' / '.join(f'{e:.4f}' for e in a)} | {' / '.join(f'{e:.4f}' for e in b)} |")
        else:
            vrows.append(f"| {name} | {' / '.join(f'{e:.4f}' for e in a)} | {bad:.2%} |")
    return rows + [""] + vrows


# --- EMA tracking under a gradient stream ----------------------------------------------------


def track_one(cm, cv, shape, steps, device, spread, beta1=0.9, beta2=0.999, eps=1e-8) -> tuple[float, float]:
    """Mean relative error of the AdamW update, and mean sqrt(v) of the stopped rows vs fp32."""
    gen = torch.Generator().manual_seed(1)
    if spread == "rows":  # gradient scale varies between rows (blocks), not within them
        sigma = torch.exp(1.5 * torch.randn(shape[0], 1, generator=gen)).expand(shape)
    else:  # and within blocks: per-element lognormal scales
        sigma = torch.exp(1.0 * torch.randn(shape, generator=gen))
    sigma = 1e-3 * sigma.to(device)
    mu = (0.5 * torch.randn(shape, generator=gen)).to(device) * sigma
    stop = torch.zeros(shape, dtype=torch.bool, device=device)
    stop[: shape[0] // 4] = True  # these rows get no gradient in the second half (e.g. unused embeddings)
    noise = torch.Generator(device=device).manual_seed(2)
    m = torch.zeros(shape, device=device)
    v = torch.zeros(shape, device=device)
    sm, sv = cm.zeros(shape, device), cv.zeros(shape, device)
    errs, late = [], []
    for t in range(1, steps + 1):
        g = mu + sigma * torch.randn(shape, generator=noise, device=device)
        if t > steps // 2:
            g = torch.where(stop, 0.0, g)
        m = m * beta1 + g * (1 - beta1)
        v = v * beta2 + g * g * (1 - beta2)
        # as the optimizer: decode, fp32 EMA, the update from these values, encode
        mq = cm.decode(sm) * beta1 + g * (1 - beta1)
        vq = cv.decode(sv) * beta2 + g * g * (1 - beta2)
        sm, sv = cm.encode(mq, bits_fn(16, t, shape, device)), cv.encode(vq, bits_fn(17, t, shape, device))
        if t > min(200, steps // 4) and t % 10 == 0:
            bc1, bc2 = 1 - beta1**t, math.sqrt(1 - beta2**t)
            u = (m / bc1) / (v.sqrt() / bc2 + eps)
            uq = (mq / bc1) / (vq.sqrt() / bc2 + eps)
            errs.append(((uq - u).norm() / u.norm()).item())
            if t > steps * 3 // 4:  # stopped rows: sqrt(v) should keep decaying as beta2**(t/2)
                late.append((vq[stop].sqrt().mean() / v[stop].sqrt().mean()).item())
    return sum(errs) / len(errs), sum(late) / len(late)


def track(device, steps, bits_list=(8, 4), which=("maps", "pairs"), select=None) -> list[str]:
    shape = torch.Size([64, 257])
    rows = [
        "| m / v format | B/elem (m+v) | update rel. err, scale spread across blocks | within blocks | "
        "stopped rows: sqrt(v) / fp32 |",
        "|---|---|---|---|---|",
    ]
    runs = [(16, "bf16", "bf16")]
    if "maps" in which:
        runs += [(bits, name, "fp32") for (bits, signed), names in MAPS.items() if signed for name in names]
        runs += [(bits, "fp32", name) for (bits, signed), names in MAPS.items() if not signed for name in names]
    if "pairs" in which:
        runs += [(bits, m, v) for bits, pairs in PAIRS.items() for m, v in pairs]
    for bits, m, v in runs:
        if bits not in bits_list and not (bits == 16 and 8 in bits_list):
            continue
        if select is not None and label(bits, m, v) not in select:
            continue
        if bits == 16:
            cm = cv = BF16
            size, m, v = 4.0, "bf16", "bf16"
        else:
            cm, cv = make(bits, True, m, shape), make(bits, False, v, shape)
            size = bytes_per_element(bits, m) + bytes_per_element(bits, v)
        e_rows, _ = track_one(cm, cv, shape, steps, device, "rows")
        e_elem, late = track_one(cm, cv, shape, steps, device, "elements")
        rows.append(f"| {label(bits, m, v)} | {size:.3f} | {e_rows:.4f} | {e_elem:.4f} | {late:.3f} |")
        print(rows[-1], flush=True)
    return rows


# --- end-to-end training ---------------------------------------------------------------------


def corpus(n_bytes: int) -> torch.Tensor:
    return stdlib_source_bytes(n_bytes).long()


class CandidateAdamW(fusedopt.AdamW):
    """fusedopt.AdamW with the compressed tensors' codecs replaced by a candidate's."""

    def __init__(self, params, make_codecs, **kw):
        self._make_codecs = make_codecs
        super().__init__(params, **kw)

    def codecs(self, p, group):
        if p.ndim < 2 or p.numel() < group["min_compress_numel"]:
            return {"exp_avg": FP32, "exp_avg_sq": FP32}
        return self._make_codecs(p.shape)


def byte_model(ctx: int, device) -> torch.nn.Module:
    """The byte-level next-token MLP both studies train (context of ``ctx`` bytes)."""
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 48),
        torch.nn.Flatten(),
        torch.nn.Linear(48 * ctx, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 256),
    ).to(device)


def train_one(make_codecs, seed, device, steps, ctx=16, batch=256) -> float:
    data = corpus(1_200_000).to(device)
    split = int(len(data) * 0.9)
    torch.manual_seed(seed)
    model = byte_model(ctx, device)
    if make_codecs is None:
        opt = fusedopt.AdamW(model.parameters(), lr=2e-3, state_bits=32, seed=seed)
    else:
        opt = CandidateAdamW(model.parameters(), make_codecs, lr=2e-3, state_bits=8, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.arange(ctx + 1, device=device)

    def batch_at(lo, hi, g):
        starts = torch.randint(lo, hi - ctx - 1, (batch,), generator=g, device=device)
        w = data[starts[:, None] + offsets]
        return w[:, :ctx], w[:, ctx]

    for _ in range(steps):
        x, y = batch_at(0, split, gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(1234)
        losses = [
            torch.nn.functional.cross_entropy(model(x), y)
            for x, y in (batch_at(split, len(data), g) for _ in range(20))
        ]
    return torch.stack(losses).mean().item()


def train(device, steps, bits_list=(8, 4), select=None, seeds=(0, 1)) -> list[str]:
    rows = ["| m / v format | held-out loss (mean of seeds) | vs fp32 state |", "|---|---|---|"]
    runs = [("fp32 (state_bits=32)", None)]
    if 8 in bits_list and select is None:
        runs.append(("bf16 (state_bits=16)", lambda s: {"exp_avg": BF16, "exp_avg_sq": BF16}))
    for b in bits_list:
        for m, v in TRAINED[b]:
            if select is not None and label(b, m, v) not in select:
                continue
            runs.append(
                (
                    label(b, m, v),
                    lambda s, b=b, m=m, v=v: {"exp_avg": make(b, True, m, s), "exp_avg_sq": make(b, False, v, s)},
                )
            )
    ref = None
    for name, mk in runs:
        loss = sum(train_one(mk, seed, device, steps) for seed in seeds) / len(seeds)
        ref = loss if ref is None else ref
        rows.append(f"| {name} | {loss:.4f} | {loss - ref:+.4f} |")
        print(rows[-1], flush=True)
    return rows


def spread(device, steps=400, ctx=16, batch=256) -> list[str]:
    """How spread out are real moments inside a block? torch.optim.AdamW on the training task."""
    data = corpus(1_200_000).to(device)
    torch.manual_seed(0)
    model = byte_model(ctx, device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    offsets = torch.arange(ctx + 1, device=device)
    for _ in range(steps):
        w = data[torch.randint(0, len(data) - ctx - 1, (batch,), device=device)[:, None] + offsets]
        torch.nn.functional.cross_entropy(model(w[:, :ctx]), w[:, ctx]).backward()
        opt.step()
        opt.zero_grad()
    rows = [
        "| weight | std of log sqrt(v) within a block of 32 (median over blocks) | exact zeros in v |",
        "|---|---|---|",
    ]
    for name, p in model.named_parameters():
        if p.ndim == 2:
            v = opt.state[p]["exp_avg_sq"].reshape(-1)
            blocks = v[: v.numel() // 32 * 32].view(-1, 32)
            nonzero = blocks.gt(0).all(1)
            logs = blocks[nonzero].sqrt().log()
            within = logs.std(1).median().item() if nonzero.any() else float("nan")
            rows.append(f"| {name} {tuple(p.shape)} | {within:.2f} | {(v == 0).float().mean().item():.1%} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("roundtrip", "track", "train", "spread", "all"), default="all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke test, not the recorded figures)")
    ap.add_argument("--select", nargs="+", help="track, train: only these labels, e.g. 'int8 m sq, v cube'")
    ap.add_argument("--track", nargs="+", default=["maps", "pairs"], help="track: level maps alone, pairs")
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4], help="track, train: which state_bits")
    args = ap.parse_args()
    device = torch.device(args.device)
    t0 = time.time()
    parts = ("roundtrip", "spread", "track", "train") if args.part == "all" else (args.part,)
    for part in parts:
        if part == "roundtrip":
            rows = roundtrip(device)
        elif part == "spread":
            rows = spread(device)
        elif part == "track":
            rows = track(device, 300 if args.quick else 2400, args.bits, args.track, args.select)
        else:
            rows = train(device, 30 if args.quick else 1500, args.bits, args.select)
        print(f"\n### {part}\n")
        print("\n".join(rows), flush=True)
    print(f"\n({time.time() - t0:.0f} s on {device})")


if __name__ == "__main__":
    main()
