"""Readable memory summaries for the examples: sizes in B / KiB / MiB / GiB, a few short lines.

Imported by ``finetune_lowvram.py`` and ``finetune_hf.py`` (Python puts the script's own
directory on ``sys.path``, so this works from any working directory).
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1, to 3 significant digits.

    512 -> "512 B", 3072 -> "3.00 KiB", 2.5 * 2**20 -> "2.50 MiB", 1.2 * 2**30 -> "1.20 GiB",
    123.4 * 2**20 -> "123 MiB". Whole bytes are printed as integers.
    """
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(round(value))} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {_UNITS[unit]}"


def summarize(memory, num_params: int) -> str:
    """A ``fusedopt.profile.StepMemory`` as a few lines: peak, what the peak holds, what persists."""
    cats = memory.peak_breakdown.categories
    parts = [f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in cats.items()]
    return "\n".join(
        [
            f"memory of the last step ({memory.method['peak']}):",
            f"  peak        {format_bytes(memory.peak)} in {memory.peak_phase}"
            f" (largest part: {memory.dominant.replace('_', ' ')})",
            f"  at the peak {', '.join(parts)}",
            f"  persistent  {format_bytes(memory.persistent)} between steps"
            f" = {memory.persistent / num_params:.2f} bytes per parameter",
        ]
    )
