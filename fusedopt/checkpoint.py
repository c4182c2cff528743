"""Optimizer checkpoints: save and load fusedopt state without losing or misreading anything.

Two rules on top of torch's ``Optimizer.load_state_dict``:

* State tensors keep their saved dtypes (torch casts floating state to the parameter dtype,
  which would turn fp32 moments of a bf16 parameter into bf16).
* As in torch, saved group options win (``state_bits`` and friends included); options the
  saved groups lack (a ``torch.optim.AdamW`` checkpoint has no ``state_bits``) keep the
  optimizer's own and the saved state is converted to them. Conversion that loses precision
  is reported with a warning giving the error; anything that cannot be converted (missing
  or unknown entries, wrong shapes, another algorithm) raises and leaves the optimizer as it was.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import torch

from . import rng
from .clipping import ReleaseClipping
from .codecs import MomentCodec, codec_named, registered_formats
from .master import MASTER_CORRECTION, convert_correction
from .state_memory import pack_tensors

# 3: each state's codec recorded by name ("codecs"). 2: not recorded; 8-bit moments on
# shifted-minifloat levels. 1: 8-bit moments on square levels (the codec "block8-square"), converted
# on load (the codes' layout is the same, so they must not be copied as they are).
FORMAT = 3
# torch.optim group keys that fusedopt drops when loading a torch checkpoint: implementation
# switches with no effect on the state. Other keys of a saved group are kept as torch keeps them
# (a scheduler's initial_lr, a user's own "name"), except those that change the algorithm:
# amsgrad=True, and torch.optim.Adam's coupled L2 weight decay (decoupled_weight_decay=False).
_IGNORED_FOREIGN_KEYS = {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"}
# Hyperparameters of torch.optim's and fusedopt's optimizers: one this optimizer does not have
# means the checkpoint is another algorithm's (an SGD checkpoint has momentum, an AdamW one eps).
_OTHER_ALGORITHMS_KEYS = {"betas", "eps", "momentum", "dampening", "nesterov", "lr_decay", "rho", "alpha", "centered"}


def state_dict(optimizer, packed: dict) -> dict:
    """Add fusedopt's optimizer-wide entries to torch's packed state dict."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    packed["fusedopt"] = {
        "format": FORMAT,
        "algorithm": optimizer.algorithm,
        "seed": optimizer.seed,
        "num_skipped_updates": optimizer.num_skipped_updates,
        # 4-bit codes and block scales are flat: only the shapes tell two parameters of one size apart
        "shapes": {i: list(params[i].shape) for i in packed["state"]},
        # the format of each stored moment: two formats may share a layout
        "codecs": {i: _codec_names(optimizer, params[i]) for i in packed["state"]},
    }
    if optimizer._released_clipping is not None:  # the history of clipping under release (clipping.py)
        pids = {optimizer.param_index(p): i for i, p in enumerate(params)}
        packed["fusedopt"]["release_clipping"] = optimizer._released_clipping.state_dict(pids)
    return packed


def _load_release_clipping(optimizer, meta: dict | None, ids: dict):
    """The history of clipping under release from a checkpoint, in a new ``ReleaseClipping`` (None:
    nothing to load, or this optimizer does not clip)."""
    saved = meta.get("release_clipping") if meta is not None else None
    if saved is None or optimizer._released_clipping is None:
        return None
    clipping = ReleaseClipping(optimizer.max_grad_norm, optimizer.release_clipping)
    indices = {pid: (optimizer.param_index(p), p.device) for pid, (p, _) in ids.items()}
    try:
        clipping.load_state_dict(saved, indices)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"checkpoint has an invalid release_clipping entry: {e!r}") from e
    return clipping


def _codec_names(optimizer, p: torch.Tensor) -> dict[str, str]:
    state = optimizer.state.get(p)
    if not state:
        return {}
    group, _ = optimizer.position(p)
    return {slot: codec.name for slot, codec in optimizer.codecs(p, group).items()}


def load_state_dict(optimizer, saved: dict) -> None:
    """Load ``saved`` into ``optimizer`` (see the module docstring); all-or-nothing."""
    saved = saved.copy()
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, saved)
        if result is not None:
            saved = result

    meta = saved.get("fusedopt")
    if meta is not None:
        if meta.get("format", 0) > FORMAT:
            raise ValueError(f"checkpoint format {meta.get('format')} is newer than this fusedopt ({FORMAT})")
        if meta.get("algorithm") != optimizer.algorithm:
            raise ValueError(
                f"checkpoint holds {meta.get('algorithm')!r} state; it cannot be loaded into fusedopt."
                f"{type(optimizer).__name__}"
            )

    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )

    new_groups = [_merge_group(optimizer, g, s) for g, s in zip(groups, saved_groups)]
    seed = _load_seed(meta["seed"] if meta is not None else optimizer.seed)
    skipped = _load_counter(meta) if meta is not None else None
    shapes = meta.get("shapes", {}) if meta is not None else {}
    codec_names = meta.get("codecs", {}) if meta is not None else {}
    saved_format = meta.get("format", 0) if meta is not None else None  # None: not fusedopt's
    lossy: list[str] = []
    new_state: defaultdict = defaultdict(dict)
    ids = {pid: (p, g) for g, s in zip(new_groups, saved_groups) for pid, p in zip(s["params"], g["params"])}
    for pid, param_state in saved["state"].items():
        if pid not in ids:
            raise ValueError(f"loaded state dict has state for parameter id {pid!r}, which no group lists")
        p, group = ids[pid]
        _, index = optimizer.position(p)
        where = f"parameter {index} (shape {tuple(p.shape)})"
        if pid in shapes and list(shapes[pid]) != list(p.shape):
            raise ValueError(
                f"loaded state dict holds the state of a parameter of shape {tuple(shapes[pid])} for {where}: the "
                "parameters are not the ones it was saved from (another model, or another order)"
            )
        names = codec_names.get(pid, {})
        new_state[p] = _convert_param_state(
            optimizer, p, group, param_state, where, seed, index, lossy, saved_format, names
        )

    clipping = _load_release_clipping(optimizer, meta, ids)

    # Everything validated and converted: commit (the shared corrections are built, if they were
    # not, before the first one is overwritten).
    for p, state in new_state.items():
        optimizer.share_correction(p, state, new_groups)
    for i, group in enumerate(new_groups):
        groups[i] = group
    optimizer.state = new_state
    optimizer.seed = seed
    if skipped is not None:
        optimizer.num_skipped_updates.copy_(skipped)
    if clipping is not None:
        optimizer._released_clipping = clipping
    if lossy:
        warnings.warn(
            "checkpoint state was converted to this optimizer's state format with rounding: " + "; ".join(lossy),
            stacklevel=3,
        )
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


def _merge_group(optimizer, group: dict, saved_group: dict) -> dict:
    merged = dict(group)
    for key, value in saved_group.items():
        if key == "params" or key in _IGNORED_FOREIGN_KEYS:
            continue
        if key == "amsgrad" and key not in optimizer.defaults:
            if value:
                raise ValueError("checkpoint was saved with amsgrad=True, which fusedopt does not support")
            continue
        if key in _OTHER_ALGORITHMS_KEYS and key not in optimizer.defaults:
            raise ValueError(
                f"loaded parameter group has {key!r}, an option of another optimizer than "
                f"fusedopt.{type(optimizer).__name__}"
            )
        merged[key] = value
    if saved_group.get("decoupled_weight_decay") is False and saved_group.get("weight_decay", 0) != 0:
        raise ValueError(
            "checkpoint was saved by torch.optim.Adam with weight_decay (L2 added to the gradient); "
            f"fusedopt.{type(optimizer).__name__} decays the weights directly, a different algorithm"
        )
    optimizer.check_group(merged)
    return merged


def _load_seed(seed) -> int:
    if not rng.valid_seed(seed):
        raise ValueError(f"checkpoint has an invalid seed: {seed!r} (expected a non-negative integer)")
    return seed


def _load_counter(meta: dict) -> torch.Tensor:
    counter = meta.get("num_skipped_updates")
    if isinstance(counter, torch.Tensor) and not counter.is_floating_point() and counter.numel() == 1:
        return counter.reshape(()).to(torch.int64)
    if isinstance(counter, int) and not isinstance(counter, bool) and counter >= 0:
        return torch.tensor(counter, dtype=torch.int64)
    raise ValueError(f"checkpoint has an invalid num_skipped_updates: {counter!r} (expected an integer count)")


def _convert_param_state(
    optimizer, p, group, saved: dict, where: str, seed: int, index: int, lossy: list, saved_format: int | None, names
) -> dict:
    if not isinstance(saved, dict):
        raise ValueError(f"state of {where} is a {type(saved).__name__}, expected a dict")
    saved = {k: v for k, v in saved.items() if v is not None}  # torch.optim.SGD saves momentum_buffer=None
    # Master-weight correction: copied, widened, or zero when absent (master = the loaded bf16 value).
    correction = convert_correction(p, group["master_weight_bits"], saved.pop(MASTER_CORRECTION, None), where)
    codecs: dict[str, MomentCodec] = optimizer.codecs(p, group)
    known = {"step"} | {slot + s for slot, codec in codecs.items() for s in codec.layout(p.shape)}
    foreign_slots = {k for k in saved if k not in known and not any(_of_slot(k, slot) for slot in codecs)}
    if foreign_slots:
        raise ValueError(f"state of {where} has entries this optimizer does not keep: {sorted(foreign_slots)}")

    step = _load_step(saved.get("step"), where, has_moments=any(k != "step" for k in saved), optimizer=optimizer)
    out = {"step": torch.tensor(step, dtype=torch.float32, device=p.device)}
    draws = rng.UpdateDraws(seed, index, out["step"], p, None)  # re-encoding rounds like an update
    for i, (slot, codec) in enumerate(codecs.items()):
        layout = codec.layout(p.shape)
        entries = {s: saved.get(slot + s) for s in layout}
        signed = slot not in optimizer.nonnegative_slots
        source = _saved_codec(slot, saved, p.shape, signed, saved_format, names.get(slot), where)
        same_format = source is None or source is _PLAIN or source.name == codec.name
        if same_format and all(
            isinstance(t, torch.Tensor) and (t.dtype, t.shape) == layout[s] for s, t in entries.items()
        ):
            out.update({slot + s: t.detach() for s, t in entries.items()})  # copied to p.device by pack_tensors
            continue
        value = saved.get(slot)
        if value is None and not any(_of_slot(k, slot) for k in saved):
            if step != 0:
                raise ValueError(f"state of {where} lacks {slot!r} although it was updated {step:g} times")
            out.update({slot + s: t for s, t in codec.zeros(p.shape, p.device).items()})
            continue
        if source is None:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            target = codec.name
            raise ValueError(f"state {slot!r} of {where} cannot be converted to the state format {target!r}: got {got}")
        decoded = source.decode({s: saved[slot + s].detach().to(p.device) for s in source.suffixes}).float()
        origin = str(value.dtype) if source is _PLAIN else source.name
        encoded = codec.encode(decoded, draws.moment(i))
        error = (codec.decode(encoded) - decoded).abs().max().item() if decoded.numel() else 0.0
        if error > 0:
            scale = decoded.abs().max().item()
            change = f"{origin} -> {codec.name}"
            lossy.append(f"{slot} of {where}: {change}, max abs error {error:.3g} (max |x| {scale:.3g})")
        out.update({slot + s: t for s, t in encoded.items()})
    out.update(correction)
    step_tensor = out.pop("step")
    return {"step": step_tensor, **pack_tensors(out, p.device)}  # shared allocations, as a fresh state


def _of_slot(key: str, slot: str) -> bool:
    """Whether a state key is the slot's own or one of its codec's entries (``exp_avg.codes``, not ``exp_avg_sq``)."""
    return key == slot or key.startswith(slot + ".")


def _saved_codec(
    slot: str, saved: dict, shape: torch.Size, signed: bool, saved_format: int | None, name: str | None, where: str
) -> MomentCodec | None:
    """The codec that wrote ``slot`` in a saved state: the one the checkpoint names, else a plain
    float tensor (fusedopt's fp32/bf16 or torch.optim's), else a block codec of the checkpoint's
    format whose layout matches exactly (None: unrecognised)."""
    value = saved.get(slot)
    if not any(_of_slot(key, slot) for key in saved):
        return None  # not saved at all: the caller says what is missing
    if name is not None:
        if name not in registered_formats():
            raise ValueError(
                f"state {slot!r} of {where} was saved in the state format {name!r}, which this fusedopt does not "
                f"know (known: {', '.join(registered_formats())})"
            )
        codec = codec_named(name, signed, torch.Size(shape))
        layout = codec.layout(shape)
        if not all(_fits(saved.get(slot + s), dtype, size) for s, (dtype, size) in layout.items()):
            got = {s: _describe(saved.get(slot + s)) for s in layout}
            raise ValueError(
                f"state {slot!r} of {where} cannot be converted: it does not have the layout of its saved state "
                f"format {name!r} (got {got})"
            )
        return codec
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == shape:
        return _PLAIN
    for candidate_name in _UNNAMED_BLOCK_FORMATS[1 if saved_format is not None and saved_format <= 1 else 2]:
        candidate = codec_named(candidate_name, signed, torch.Size(shape))
        layout = candidate.layout(shape)
        if all(_fits(saved.get(slot + s), dtype, size) for s, (dtype, size) in layout.items()):
            return candidate
    return None


# The block formats of checkpoints that did not record codec names (formats 1 and 2), tried by layout.
_UNNAMED_BLOCK_FORMATS = {1: ("block8-square", "block4"), 2: ("block8", "block4")}


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _fits(t, dtype: torch.dtype, shape: torch.Size) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape


class _PlainCodec(MomentCodec):
    """Any floating tensor under the slot's own name (decoded to fp32)."""

    def decode(self, stored):
        return stored[""].float()


_PLAIN = _PlainCodec()


def _load_step(value, where: str, *, has_moments: bool, optimizer) -> float:
    if value is None:
        if not optimizer.torch_saves_step:  # e.g. torch.optim.SGD: a buffer means it has stepped
            return 1.0 if has_moments else 0.0
        raise ValueError(f"state of {where} has no 'step' entry")
    step = float(value.item() if isinstance(value, torch.Tensor) else value)
    if not math.isfinite(step) or step < 0 or step != int(step) or step > 2**24:
        raise ValueError(f"state of {where} has an invalid step count: {value!r}")
    return step


def torch_state_dict(optimizer) -> dict:
    """The optimizer's state as ``torch.optim.AdamW`` / ``torch.optim.SGD`` would save it.

    Moments are decoded to fp32; fusedopt's own options and the master-weight corrections are
    left out (the master itself lives in the weights: see ``fusedopt.master_state_dict``).
    """
    if optimizer.torch_group_keys is None:
        raise ValueError(f"torch.optim has no counterpart of fusedopt.{type(optimizer).__name__}")
    packed = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, p in enumerate(params):
        if p not in optimizer.state or not optimizer.state[p]:
            continue
        group, _ = optimizer.position(p)
        saved = optimizer.state[p]
        entry = {"step": saved["step"].detach().clone().cpu()}
        for slot, codec in optimizer.codecs(p, group).items():
            stored = {s: saved[slot + s] for s in codec.suffixes}
            entry[slot] = codec.decode(stored).detach().float().clone()
        if not optimizer.torch_saves_step:
            entry.pop("step")
            for slot in optimizer.slots:
                entry.setdefault(slot, None)
        state[index] = entry
    fusedopt_only = ("state_bits", "state_format", "master_weight_bits", "min_compress_numel")
    groups = []
    for group in packed["param_groups"]:
        torch_group = {k: v for k, v in group.items() if k not in fusedopt_only}
        torch_group.update(optimizer.torch_group_keys)
        groups.append(torch_group)
    return {"state": state, "param_groups": groups}
