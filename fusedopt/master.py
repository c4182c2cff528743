"""Master weights: how the full-precision value of a parameter is held.

fp32 parameters are their own master. For bf16/fp16 parameters, ``master_weight_bits``
selects the scheme:

* ``None``: no correction term; each update is written to the parameter dtype with
  stochastic rounding, so updates below one ulp still land in expectation.
* ``24`` / ``32``: the parameter plus an int8 / int16 correction in the optimizer state
  (master-weight splitting). Not available yet: it lands with the compressed-state work.
"""

from __future__ import annotations

import torch

from .rounding import LOW_PRECISION, round_stochastic

SUPPORTED_MASTER_WEIGHT_BITS = (None,)
PLANNED_MASTER_WEIGHT_BITS = (24, 32)


def check_master_weight_bits(bits, dtypes: set[torch.dtype]) -> None:
    """Validate a group's ``master_weight_bits`` against the dtypes of its parameters."""
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int)):
        raise ValueError(f"Invalid master_weight_bits: {bits!r} (expected 24, 32 or None)")
    if bits in SUPPORTED_MASTER_WEIGHT_BITS:
        return
    if bits in PLANNED_MASTER_WEIGHT_BITS:
        if dtypes & set(LOW_PRECISION):
            raise NotImplementedError(
                f"master_weight_bits={bits} (bf16/fp16 parameter + integer correction) is not supported yet; "
                "pass master_weight_bits=None (stochastic rounding) for bf16/fp16 parameters"
            )
        return  # ignored for fp32 parameters
    raise ValueError(f"Invalid master_weight_bits: {bits!r} (expected 24, 32 or None)")


def correction_zeros(param: torch.Tensor, master_weight_bits) -> dict[str, torch.Tensor]:
    """State entries the master scheme keeps beside the parameter (none without splitting)."""
    return {}


def read_master(param: torch.Tensor, state: dict, master_weight_bits) -> torch.Tensor:
    """The full-precision (fp32) master value of ``param`` (``state``: its optimizer state)."""
    return param.float()


def write_master(
    param: torch.Tensor, value: torch.Tensor, state: dict, master_weight_bits, bits
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Store fp32 ``value``: the new parameter tensor and the new state entries of the scheme.

    ``bits`` lazily draws uniform bits for stochastic rounding. Nothing is written here; the
    caller commits (so a skipped update leaves everything untouched).
    """
    if param.dtype == torch.float32:
        return value, {}
    return round_stochastic(value, bits(), param.dtype), {}
