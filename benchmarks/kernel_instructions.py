"""Static SASS instructions per element of fusedopt's step kernels, per configuration, on any machine.

    python benchmarks/kernel_instructions.py                     # the default, norm2-root4, block4, Adafactor
    python benchmarks/kernel_instructions.py --configs "fusedopt.AdamW:state_bits=32" --opcodes 12
    python benchmarks/kernel_instructions.py --configs "fusedopt.AdamW" --statements   # where they go
    python benchmarks/kernel_instructions.py --configs "fusedopt.AdamW:state_format='norm2-root4'" --lines rootgrid

No GPU needed: each configuration takes one step on the CPU under Triton's interpreter (a child
process) while every kernel launch is recorded (argument types, 16-byte alignment, constexprs,
options); this process then compiles each recorded launch for sm_90 with Triton's own ptxas and
counts the instructions of its SASS. The kernels are straight-line code (no loops over elements), so
a program's static count divided by the elements it owns approximates the executed instructions
per element, per thread of the program (the work the issue slots see); a one-off branch (the check
kernel's last program) is counted as if every program took it, so check kernels read high. The update
kernel is compiled without its branch for a tensor's partial last tile (``update._PARTIAL_TILES``): the
counts and registers are those of the whole-tile path every other tile takes (the kernel with both
branches allocates the larger of the two paths' registers).

``--statements`` splits the update kernel's count by the statement of ``_update_tile`` whose code each
instruction was inlined from (the line information of ``nvdisasm -gi``), and Adafactor's element-wise
kernels' by the innermost statement of ``kernels/factored.py``, on their fast path: without the
out-of-line slow paths of IEEE division and square root and the calls to them, which no finite,
normal input takes (the full count above includes them); a branch's two sides both count, but for the code
of a kernel line marked ``# rare branch`` (AdamW's IEEE fallback for an eps below the flush-safe bound).

``--lines MODULE ...`` also splits the update kernel's fast path by the innermost line of these modules of
``kernels/`` (e.g. ``rootgrid normalised moments``): where a codec's own instructions go.

``--layouts`` lists each kernel's layout conversions (``ttg.convert_layout`` in its TTGIR, by the
source lines they come from, innermost first) and counts its barriers (``BAR.SYNC``): a conversion
between register layouts goes through shared memory and waits for every warp of the program.

``--pipes`` adds each kernel's instructions per element by the execution pipe its opcodes issue to on
sm_90 (``PIPES``, an approximation by opcode: ``PIPES=1 kernel_counters.sh`` measures the shares), e.g. the
16-lane ALU pipe that limits ``norm2-root4``'s update.

The local Triton may differ from the GPU machine's: compare counts made with one Triton only.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

DEFAULT_CONFIGS = (
    "fusedopt.AdamW",
    "fusedopt.AdamW:master_weight_bits=None",
    "fusedopt.AdamW:state_bits=4",
    "fusedopt.AdamW:state_format='norm2-root4'",
    "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None",
    "fusedopt.AdamW:state_bits=32,master_weight_bits=32",
    "fusedopt.Adafactor",
)
SHAPE = (24, 1104)  # rows longer than a tile (as a model's matrices) and a multiple of 16 elements (vector accesses)
# elements each program owns, by kernel name (the update's: its launch's tile; a kernel missing here is
# reported per program)
ELEMENTS = {"_check_kernel": "CHECK", "_usq_kernel": "FACTORED", "_apply_kernel": "FACTORED"}


def _capture(configs: list[str], out: str, root_grid_tile=None) -> None:
    """Child process: one step of each configuration under the interpreter; every launch recorded."""
    from fusedopt.kernels import factored, launcher, update

    if root_grid_tile:
        update.ROOT_GRID_TILE = update.ROOT_GRID_UNCORRECTED_TILE = tuple(root_grid_tile)
    from fusedopt.profile import parse_config

    records = []
    original = launcher.DirectLauncher._launch_through_triton

    def record(self, grid, runtime_args, config):
        args = []
        for a in runtime_args:
            if isinstance(a, torch.Tensor):
                args.append(["tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0])
            elif isinstance(a, bool) or not isinstance(a, (int, float)):
                raise TypeError(f"unrecorded argument type {type(a).__name__}")
            else:
                args.append(["int" if isinstance(a, int) else "float", a, None])
        name = self.fn.fn.__name__ if hasattr(self.fn, "fn") else self.fn.__name__
        records.append(
            dict(config=current, kernel=name, args=args, constexprs=config.constexprs, options=config.options)
        )
        return original(self, grid, runtime_args, config)

    launcher.DirectLauncher._launch_through_triton = record
    sizes = dict(CHECK=update.CHECK_TILE * update.CHECK_TILES, FACTORED=factored.BLOCK)
    for current in configs:
        torch.manual_seed(0)
        config = parse_config(current)
        p = torch.nn.Parameter(torch.randn(SHAPE, dtype=torch.bfloat16))
        p.grad = torch.randn_like(p)
        opt = config.build([p], device_type="cpu")
        opt.step()
    with open(out, "w") as f:
        json.dump(dict(records=records, sizes=sizes), f, default=lambda v: v if not isinstance(v, tuple) else list(v))


class _NoGPU:
    """Triton's active driver for compiling sm_90 code on a machine without a GPU (nothing launches)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _fake_argument(kind, value, aligned):
    if kind == "tensor":
        t = torch.zeros(64, dtype=getattr(torch, value))
        return t if aligned else t[1:]
    return value


def _compile(kernel_fn, record):
    """The recorded launch compiled for sm_90 (Triton's cache makes a second compile of it cheap)."""
    args = [_fake_argument(*a) for a in record["args"]]
    return kernel_fn.warmup(*args, grid=(1,), **record["constexprs"], **record["options"])


def _sass(kernel_fn, record, lines: bool = False) -> tuple[str, int]:
    """The SASS of the recorded launch compiled for sm_90 (with ``lines``: nvdisasm's, with the line
    information), and its registers per thread."""
    from triton import knobs

    compiled = _compile(kernel_fn, record)
    cuobjdump = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        command = [knobs.nvidia.nvdisasm.path, "-gi", "-c", f.name] if lines else [cuobjdump, "-sass", f.name]
        sass = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    return sass, int(found.group(1)) if found else -1


_LOC = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.M)


def layout_conversions(ttgir: str) -> list[str]:
    """Each ``ttg.convert_layout`` of a TTGIR module, as the source lines it comes from ("file.py:line",
    innermost first, joined by " < "), in the order of the module."""
    definitions = dict(_LOC.findall(ttgir))

    def frames(name: str, depth: int = 0) -> list[str]:
        text = definitions.get(name, "")
        if depth > 64 or not text:
            return []
        if found := re.fullmatch(r'"([^"]*)":(\d+):\d+', text):
            return [f"{os.path.basename(found.group(1))}:{found.group(2)}"]
        if found := re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", text):
            return frames(found.group(1), depth + 1) + frames(found.group(2), depth + 1)
        if found := re.fullmatch(r'"[^"]*"\((#loc\d*)\)', text):
            return frames(found.group(1), depth + 1)
        return []

    return [" < ".join(frames(loc)) or loc for loc in re.findall(r"ttg\.convert_layout .*loc\((#loc\d*)\)", ttgir)]


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def count(sass: str) -> collections.Counter:
    """Opcodes (with modifiers) of the SASS, without the padding NOPs and the final self-branch."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = _INSTRUCTION.search(line)
        if m and not m.group(2).startswith("NOP"):
            ops[m.group(2)] += 1
    ops["BRA"] -= 1  # the trailing `BRA self` after EXIT
    return +ops


# The execution pipe of sm_90 SASS opcodes, by their first word (the rest: "other")
PIPES = {
    "alu": ("LOP3", "SHF", "FMNMX", "FSEL", "SEL", "FSETP", "ISETP", "IADD3", "LEA", "PRMT", "VIMNMX", "VIADDMNMX",
            "IMNMX", "P2R", "R2P", "SGXT", "PLOP3", "MOV", "FSET", "ISET", "BMSK", "IABS"),
    "fma": ("FFMA", "FMUL", "FADD", "IMAD", "IMUL", "HFMA2", "HMUL2", "HADD2"),
    "xu": ("MUFU", "F2F", "I2F", "F2I", "FRND", "POPC", "FLO", "BREV"),
    "lsu": ("LDG", "STG", "LDS", "STS", "LDL", "STL", "LDC", "SHFL", "ATOM", "ATOMG", "RED"),
}  # fmt: skip


def by_pipe(ops: collections.Counter) -> dict:
    """``count``'s opcodes summed by ``PIPES``' pipe."""
    pipe_of = {op: pipe for pipe, ops_ in PIPES.items() for op in ops_}
    out = dict.fromkeys([*PIPES, "other"], 0)
    for op, n in ops.items():
        out[pipe_of.get(op.split(".")[0], "other")] += n
    return out


_FRAME = re.compile(r'"([^"]+)", line (\d+)')  # a frame of nvdisasm's "//## File ..., line N inlined at ..."


RARE = "# rare branch"  # a kernel line's marker: its code runs on inputs the fast path never sees


def rare_lines(modules=("update",)) -> set:
    """(file, line) of every line marked ``RARE`` in these ``fusedopt.kernels`` modules, as imported (the
    source the compiled kernels' line information refers to)."""
    found = set()
    for name in modules:
        lines = inspect.getsourcelines(importlib.import_module(f"fusedopt.kernels.{name}"))[0]
        found |= {(f"kernels/{name}.py", n) for n, text in enumerate(lines, 1) if RARE in text}
    return found


def statements(sass: str, body: range, source: str = "kernels/update.py", rare=frozenset()) -> collections.Counter:
    """Fast-path instructions of nvdisasm ``-gi`` output by the line of ``source`` in ``body`` (for the
    update kernel the lines of ``_update_tile``) their code was inlined from, the innermost such line;
    None: the rest of the kernel. Left out: the
    out-of-line slow-path routines after the kernel's body, each call site's block (after the
    conditional branch that skips it, up to the branch back or the label after its CALL), and the code
    of a ``rare`` (file, line) (a runtime branch's side no normal input takes)."""
    counts = collections.Counter()
    where, frames = None, []  # frames: the line information since the last instruction
    in_rare = False
    pending = []  # statements of the instructions since the last conditional branch or label
    in_call = False
    kernel = re.split(r"\n\s*\.type\s+\$__internal", sass)[0]
    for text in kernel.splitlines():
        if text.lstrip().startswith("//##"):
            frames += [(f, int(n)) for f, n in _FRAME.findall(text)]
            continue
        if re.match(r"\s*\.L_x_\d+:", text):  # a label ends a call site's block too
            counts.update(pending)
            pending, in_call = [], False
            continue
        found = _INSTRUCTION.search(text)
        if not found or found.group(2).startswith("NOP"):
            continue
        if frames:
            inside = [n for f, n in frames if f.endswith(source) and n in body]
            in_rare = any(f.endswith(r) and n == line for f, n in frames for r, line in rare)
            where, frames = (inside[0] if inside else None), []
        if in_rare:
            continue
        opcode, conditional = found.group(2), bool(found.group(1))
        if in_call:
            in_call = not (opcode == "BRA" and not conditional)
        elif opcode.startswith("CALL"):
            pending, in_call = [], True
        elif opcode == "BRA" and conditional:
            counts.update(pending + [where])
            pending = []
        else:
            pending.append(where)
    counts.update(pending)
    counts[None] -= 1  # the trailing `BRA self` after EXIT
    return +counts


BY_STATEMENT = {"_update_kernel": "update", "_usq_kernel": "factored", "_apply_kernel": "factored"}


def _by_statement(fn, record) -> list:
    """[(statement, fast-path instructions per program)] of a kernel, largest first (statements of
    ``_update_tile`` for the update kernel, of ``factored.py`` for Adafactor's element-wise kernels; one
    entry for the other kernels)."""
    module = importlib.import_module(f"fusedopt.kernels.{BY_STATEMENT.get(record['kernel'], 'update')}")
    lines = inspect.getsourcelines(module)[0]
    body = range(0)
    if record["kernel"] == "_update_kernel":
        source, first = inspect.getsourcelines(module._update_tile.fn)
        body = range(first, first + len(source))
    elif record["kernel"] in BY_STATEMENT:
        body = range(1, len(lines) + 1)
    sass, _ = _sass(fn, record, lines=True)
    counts = statements(sass, body, f"kernels/{module.__name__.rsplit('.', 1)[-1]}.py", rare_lines())
    # a line of a statement of several lines counts for the statement: its first line names it
    first_line = {}
    for node in sorted(ast.walk(ast.parse("".join(lines))), key=lambda n: -getattr(n, "lineno", 0)):
        if isinstance(node, ast.stmt):
            for line in range(node.lineno, node.end_lineno + 1):
                first_line.setdefault(line, node.lineno)  # the innermost statement's
    named = collections.Counter()
    for line, n in counts.items():
        if line is None:
            name = "(the rest of the kernel)"
        else:  # a line of no statement (a function's blank end) by its number
            name = lines[first_line[line] - 1].strip().rstrip("(") if line in first_line else f"(line {line})"
        named[name] += n
    return named.most_common()


def _by_line(fn, record, modules) -> dict:
    """{module: [(line, its text, fast-path instructions per program)]} of the update kernel, by the innermost
    line of each ``kernels/`` module its instructions were inlined from, largest first."""
    sass, _ = _sass(fn, record, lines=True)
    found = {}
    for name in modules:
        lines = inspect.getsourcelines(importlib.import_module(f"fusedopt.kernels.{name}"))[0]
        counts = statements(sass, range(1, len(lines) + 1), f"kernels/{name}.py", rare_lines(("update", name)))
        found[name] = [(n, lines[n - 1].strip(), k) for n, k in counts.most_common() if n is not None]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, help="fusedopt-profile --config strings")
    parser.add_argument("--opcodes", type=int, default=0, help="also the N most frequent opcodes per kernel")
    parser.add_argument("--root-grid-tile", help="ELEMENTSxWARPS of norm2-root4's programs (update.ROOT_GRID_TILE)")
    parser.add_argument(
        "--statements", action="store_true", help="also each kernel's fast path; the update kernel's by statement"
    )
    parser.add_argument(
        "--lines", nargs="+", default=(), metavar="MODULE", help="also the update's fast path by line of these modules"
    )
    parser.add_argument(
        "--layouts", action="store_true", help="also each kernel's layout conversions and barriers (BAR.SYNC)"
    )
    parser.add_argument("--pipes", action="store_true", help="also each kernel's instructions by execution pipe")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1", FUSEDOPT_BACKEND="triton")
        code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import kernel_instructions as k; "
        tile = [int(x) for x in args.root_grid_tile.split("x")] if args.root_grid_tile else None
        code += f"k._capture({list(args.configs)!r}, {path!r}, {tile!r})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        with open(path) as f:
            captured = json.load(f)
    from triton.runtime import driver

    driver.set_active(_NoGPU())
    modules = [importlib.import_module(f"fusedopt.kernels.{m}") for m in ("update", "factored", "clipping", "norms")]
    update = modules[0]
    update._PARTIAL_TILES = update.tl.constexpr(False)  # the update's whole-tile path alone
    seen, results = set(), []
    for record in captured["records"]:
        key = json.dumps([record["config"], record["kernel"], record["constexprs"]], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        fn = next(getattr(m, record["kernel"]) for m in modules if hasattr(m, record["kernel"]))
        sass, registers = _sass(fn, record)
        ops = count(sass)
        by_statement = None
        if args.statements:
            by_statement = _by_statement(fn, record)
        by_line = _by_line(fn, record, args.lines) if args.lines and record["kernel"] == "_update_kernel" else {}
        conversions = layout_conversions(_compile(fn, record).asm["ttgir"]) if args.layouts else None
        per = ELEMENTS.get(record["kernel"])
        warps = record["options"].get("num_warps", 4)
        elements = captured["sizes"][per] if per else None
        if record["kernel"] == "_update_kernel":  # the tile this configuration launched with
            elements = record["constexprs"]["NB"] * record["constexprs"]["QBLOCK"]
        total = sum(ops.values())
        # per element of one thread: a program's instructions run once per warp, each thread owning
        # elements / (32 * warps) of the program's elements
        per_element = total * 32 * warps / elements if elements else None
        results.append(
            dict(config=record["config"], kernel=record["kernel"], instructions=total, warps=warps, registers=registers)
            | dict(elements_per_program=elements, per_element=per_element, opcodes=dict(ops.most_common()))
            | dict(statements=by_statement, layout_conversions=conversions, lines=by_line)
        )
    fast = "| fast path per element " if args.statements else ""
    print(f"| configuration | kernel | SASS instructions per program | warps | registers | per element {fast}|")
    print("|---|---|---|---|---|---|" + ("---|" if fast else ""))
    for r in results:
        per = "" if r["per_element"] is None else f"{r['per_element']:.1f}"
        row = f"| {r['config']} | {r['kernel']} | {r['instructions']} | {r['warps']} | {r['registers']} | {per} |"
        if fast:
            total = sum(n for _, n in r["statements"])
            row += f" {total * r['per_element'] / r['instructions']:.1f} |" if r["per_element"] else " |"
        print(row)
        if args.opcodes:
            top = list(r["opcodes"].items())[: args.opcodes]
            print("|   | " + ", ".join(f"{op} {n}" for op, n in top) + " | | | | |")
        if args.pipes and r["per_element"]:
            scale = r["per_element"] / r["instructions"]
            pipes = by_pipe(collections.Counter(r["opcodes"])).items()
            print("|   | per element by pipe: " + ", ".join(f"{p} {n * scale:.1f}" for p, n in pipes) + " | | | | |")
    for r in results:
        if r["statements"] and r["kernel"] in BY_STATEMENT:
            scale = r["per_element"] / r["instructions"]
            total = sum(n for _, n in r["statements"])
            body = "_update_tile" if r["kernel"] == "_update_kernel" else "factored.py"
            print(f"\n{r['config']}: {r['kernel']}'s fast path, {total * scale:.1f} per element")
            print(f"| per element | statement of {body} |\n|---|---|")
            for statement, n in r["statements"]:
                print(f"| {n * scale:.1f} | `{statement}` |")
    for r in results:
        for name, rows in r["lines"].items():
            scale = r["per_element"] / r["instructions"]
            print(f"\n{r['config']}: {r['kernel']}'s fast path by line of kernels/{name}.py (the rest elsewhere)")
            print("| per element | line |\n|---|---|")
            for line, text, n in rows:
                print(f"| {n * scale:.1f} | {line}: `{text}` |")
    for r in results:
        if r["layout_conversions"] is not None:
            barriers = sum(n for op, n in r["opcodes"].items() if op.startswith("BAR.SYNC"))
            print(f"\n{r['config']}: {r['kernel']}, {barriers} barriers, layout conversions from:")
            for where in r["layout_conversions"] or ["(none)"]:
                print(f"- {where}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
