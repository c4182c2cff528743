"""Instruction counts of the update kernel's SASS, compiled for the H200 (sm_90) on any machine.

Usage (no GPU needed: Triton's bundled ptxas compiles, nvdisasm / cuobjdump read the cubin):
  python benchmarks/kernel_sass.py [--state-bits 8 16 32 4] [--formats rot8 rot4 rot2] [--dump DIR]

For each state format (AdamW, bf16 parameters; int8 correction for 8/4-bit state, none for
16/32) it prints the registers per thread, the number of SASS instructions, the most frequent
opcodes and the instructions that run at a quarter of the fp32 rate or less (MUFU and
conversions). Pointers and the element count are compiled with Triton's divisibility-by-16
hint, as a launch on large aligned tensors gets them.

Why this matters: the H200 runs of 2026-11-30 (benchmarks/RESULTS.md) showed the default step
is issue-bound: its time tracks this static count at about 4.9 us per instruction of the
per-thread program (8 elements) over 1.07e9 elements, so fewer instructions is faster, and this
count is the cheapest way to compare kernel variants before a GPU run.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedopt import codecs
from fusedopt.kernels import update

SLOW_OPCODES = ("MUFU", "I2F", "I2FP", "F2I", "FRND", "F2F", "I2I", "F2FP")
_POINTERS = (
    "param_ptr", "corr_ptr", "grad_ptr", "accum_ptr", "m_ptr", "m_scale_ptr", "v_ptr", "v_scale_ptr", "v_aux_ptr",
    "fractions_ptr",
)  # fmt: skip


def _codecs(state_bits: int | str):
    """The moments' codecs of ``state_bits``, or of the ``state_format`` named."""
    shape = torch.Size([1024, 1024])
    name = state_bits if isinstance(state_bits, str) else None
    bits = 8 if name else state_bits
    return codecs.codec_for(bits, shape, 0, state_format=name), codecs.codec_for(
        bits, shape, 0, signed=False, state_format=name
    )


_TRITON_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.uint8: "*u8", torch.int8: "*i8"}


def _state_pointer_types(prefix: str, codec) -> dict:
    """The pointer types of a moment's stored tensors, in the codec's order: values, scales, aux."""
    layout = codec.layout(torch.Size([1024, 1024]))
    names = (f"{prefix}_ptr", f"{prefix}_scale_ptr", f"{prefix}_aux_ptr")
    return {name: _TRITON_TYPES[dtype] for name, (dtype, _) in zip(names, layout.values())}


def compile_update(state_bits: int | str, kernel=None, bucket: bool = False):
    """The compiled AdamW update kernel (``kernel``: a variant's, default the real one) for bf16
    parameters and the given state format (``state_bits``, or a ``state_format`` name)."""
    kernel = kernel or update._update_kernel
    corr_bits = 8 if state_bits in (8, 4) or isinstance(state_bits, str) else 0
    m_codec, v_codec = _codecs(state_bits)
    m, v = m_codec.kernel_format, v_codec.kernel_format
    own_draw = corr_bits != 8
    config = update._update_config(0, torch.bfloat16, corr_bits, own_draw, False, False, False, m, v, update.BLOCK,
                                   update.NUM_WARPS, update.MAX_REGISTERS, False)  # fmt: skip
    cx, options = dict(config.constexprs), dict(config.options)
    value_types = {32: "*fp32", 16: "*bf16"}
    types = dict.fromkeys(_POINTERS, "*u8")
    types.update(param_ptr="*bf16", grad_ptr="*bf16", accum_ptr="*bf16", corr_ptr="*i8", step_ptr="*fp32")
    types.update(scratch_ptr="*i32", m_ptr=value_types.get(m.fmt, "*u8"), v_ptr=value_types.get(v.fmt, "*u8"))
    types.update(v_aux_ptr="*u8", fractions_ptr="*fp32")
    if isinstance(state_bits, str):  # the paired and rotated formats: their own stored dtypes
        types.update(_state_pointer_types("m", m_codec), **_state_pointer_types("v", v_codec))
    types.update(table_ptr="*i64", **{f"gd{i}": "i64" for i in range(update.BUCKET_TENSORS)})
    cx["BUCKET"] = bucket
    names = kernel.arg_names
    signature, attrs = {}, {}
    for name in names:
        if name in cx:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name in ("n_elements", "n_pairs") or name.startswith("key"):
            signature[name] = "i32"
        else:
            signature[name] = "fp32"
        if name in _POINTERS or name in ("n_elements", "n_pairs"):
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, cx, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def sass_report(kernel) -> tuple[dict, str, str]:
    """(opcode counts, SASS text, resource usage line) of a compiled kernel."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    opcodes = collections.Counter()
    for line in text.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if match:
            opcodes[match.group(1).split(".")[0]] += 1
    registers = " ".join(part for part in usage.stdout.split() if part.startswith(("REG:", "SHARED:", "LOCAL:")))
    return opcodes, text, registers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-bits", type=int, nargs="*", default=[8, 4, 16, 32])
    parser.add_argument("--formats", nargs="*", default=[], help="also these state_format names (e.g. rot8)")
    parser.add_argument("--dump", help="write each kernel's SASS to this folder")
    parser.add_argument("--variant", help="a variant of benchmarks/kernel_ablation.py instead of the real kernel")
    parser.add_argument("--bucket", action="store_true", help="the bucketed launch's kernel (kernels/bucket.py)")
    args = parser.parse_args(argv)
    kernel = None
    if args.variant:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from kernel_ablation import build_variant

        root = tempfile.mkdtemp(prefix="fusedopt_sass_")
        sys.path.insert(0, root)
        kernel = build_variant(root, args.variant)._update_kernel
    per_thread = update.BLOCK // (32 * update.NUM_WARPS)
    for bits in [*args.state_bits, *args.formats]:
        opcodes, text, registers = sass_report(compile_update(bits, kernel, args.bucket))
        total = sum(opcodes.values())
        slow = sum(count for op, count in opcodes.items() if op in SLOW_OPCODES)
        label = bits if isinstance(bits, str) else f"state_bits={bits}"
        print(f"{label}: {registers}; {total} instructions for {per_thread} elements per thread "
              f"({total / per_thread:.0f} per element), quarter-rate or slower: {slow}")  # fmt: skip
        print("   ", ", ".join(f"{op} {count}" for op, count in opcodes.most_common(16)))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"update_state{bits}.sass"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
