"""Optimizer checkpoints: save and load fusedopt state without losing or misreading anything.

Two rules on top of torch's ``Optimizer.load_state_dict``:

* State tensors keep their saved dtypes (torch casts floating state to the parameter dtype,
  which would turn fp32 moments of a bf16 parameter into bf16).
* As in torch, saved group options win (``state_bits`` and friends included); options the
  saved groups lack (a ``torch.optim.AdamW`` checkpoint has no ``state_bits``) keep the
  optimizer's own and the saved state is converted to them. Conversion that loses precision
  is reported with a warning giving the error; anything that cannot be converted (missing
  or unknown entries, wrong shapes, another algorithm) raises and leaves the optimizer as it was.

Sharded parameters (FSDP2): ``torch.distributed.checkpoint`` keeps only ``state`` and
``param_groups`` and reshards DTensors, so the state of a sharded parameter is saved as DTensors
of the parameter's global shape and placements, one value per element: block-quantized moments
as ``<slot>.element_codes`` (a code per element, 4-bit codes unpacked) and
``<slot>.element_scales`` (each element's block scale), with a ``"fusedopt"`` entry naming the
codecs. Loaded on any number of ranks, each shard's blocks are rebuilt from its elements: bit for
bit where every block's elements share one scale (the same sharding, or shards starting on
multiples of the block size), else decoded exactly and re-encoded (with the rounding warning).
DCP's ``get_optimizer_state_dict`` drops the top-level ``"fusedopt"`` entry, so for sharded
parameters its optimizer-wide part (format, algorithm, seed, skipped-update counter, the clipping
history's totals) is also written into every saved param group under ``"fusedopt"``, and each
parameter's clipping history into its own ``"fusedopt"`` entry, as plain Python values. DCP
loads into a template the loading optimizer makes, and fails on a key the checkpoint lacks, so each
history is one tuple (a single entry for DCP) or None, present whether the optimizer clips or not:
``max_grad_norm`` may be turned on or off at a resume. Loading reads them where the top-level entry
is missing.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import torch

from . import rng
from .codecs import MomentCodec, codec_named, decode_moments, known_formats, removed_format_error
from .codecs.base import check_draws, first_draws_whole, value_problems
from .master import MASTER_CORRECTION, convert_correction
from .sharding import as_sharded, element_offset, is_sharded, local
from .state_memory import pack_tensors

# 3: each state's codec recorded by name ("codecs"). 2: not recorded; 8-bit moments on
# shifted-minifloat levels. 1: 8-bit moments on square levels (the removed "block8-square", refused
# on load: the codes' layout is block8's, so they must not be read as block8's).
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
    # an empty entry (reading opt.state[p] makes one, as in torch) is no state: left out
    packed["state"] = {i: entry for i, entry in packed["state"].items() if entry}
    sharded = [i for i in packed["state"] if is_sharded(params[i])]
    if sharded:
        _check_same_steps(optimizer, [params[i] for i in sharded])
        for i in sharded:
            packed["state"][i] = _sharded_entries(optimizer, params[i], optimizer.state[params[i]])
    packed["fusedopt"] = {
        "format": FORMAT,
        "algorithm": optimizer.algorithm,
        "seed": optimizer.seed,
        "num_skipped_updates": optimizer.num_skipped_updates,
        "num_interrupted_steps": optimizer.num_interrupted_steps,
        # 4-bit codes and block scales are flat: only the shapes tell two parameters of one size apart
        "shapes": {i: list(params[i].shape) for i in packed["state"]},
        # the format of each stored moment: two formats may share a layout
        "codecs": {i: _codec_names(optimizer, params[i]) for i in packed["state"]},
        # each parameter's index, the stream of its stochastic rounding (a removed group leaves gaps)
        "indices": {i: optimizer.param_index(p) for i, p in enumerate(params)},
        # a master correction counts in steps of the parameter's dtype: bf16's and fp16's differ
        "dtypes": {i: _dtype_name(params[i]) for i in packed["state"] if MASTER_CORRECTION in packed["state"][i]},
    }
    clipping = optimizer.gradient_pipeline.clipping
    if clipping is not None:  # the history of clipping under release (clipping.py)
        pids = {optimizer.param_index(p): i for i, p in enumerate(params)}
        packed["fusedopt"]["release_clipping"] = clipping.state_dict(pids)
    if sharded:
        _fold_for_dcp(packed, sharded)
    return packed


def _number(t):
    """A 0-d tensor as a Python number (float64 values exactly); None stays None."""
    return None if t is None else t.item()


def _fold_for_dcp(packed: dict, sharded: list[int]) -> None:
    """Copy the top-level ``"fusedopt"`` entry where DCP keeps it (see the module docstring)."""
    meta = packed["fusedopt"]
    wide = {key: meta[key] for key in ("format", "algorithm", "seed")}
    wide["num_skipped_updates"] = _number(meta["num_skipped_updates"])
    wide["num_interrupted_steps"] = meta["num_interrupted_steps"]
    clipping = meta.get("release_clipping")
    wide["release_clipping"] = None
    if clipping is not None:
        wide["release_clipping"] = (clipping["method"], _number(clipping["known"]), _number(clipping["last_total"]))
    for i in sharded:
        entry = None if clipping is None else clipping["params"].get(i)
        if entry is not None:
            entry = (_number(entry.get("norm_sq")), _number(entry.get("average")), entry.get("updates"))
        packed["state"][i][STATE_META]["release_clipping"] = entry
    for group in packed["param_groups"]:
        group[STATE_META] = dict(wide)


def _unfold_from_dcp(saved_groups: list[dict]) -> dict | None:
    """The top-level ``"fusedopt"`` entry rebuilt from the param groups' copies (None: none), its
    per-parameter clipping history left to fill (``params``)."""
    wide = next((g[STATE_META] for g in saved_groups if isinstance(g.get(STATE_META), dict)), None)
    if wide is None:
        return None
    meta = dict(wide)
    clipping = meta.pop("release_clipping", None)
    if clipping is not None:
        method, known, last_total = clipping
        meta["release_clipping"] = {"method": method, "known": _tensor(known), "last_total": _tensor(last_total)}
        meta["release_clipping"]["params"] = {}
    return meta


def _unfold_history(folded) -> dict:
    """A parameter's clipping history as ``ReleaseClipping.state_dict`` holds it, from its folded tuple."""
    norm_sq, average, updates = folded
    entry = {} if norm_sq is None else {"norm_sq": _tensor(norm_sq)}
    if average is not None:
        entry.update(average=_tensor(average), updates=updates)
    return entry


def _tensor(value):
    """A folded number back as the float64 device-independent tensor the clipping history holds."""
    return None if value is None else torch.tensor(value, dtype=torch.float64)


# a sharded parameter's saved state: the codec names and the element-wise layout
STATE_META = "fusedopt"
_ELEMENT_CODES, _ELEMENT_SCALES = ".element_codes", ".element_scales"


def _check_same_steps(optimizer, params: list[torch.Tensor]) -> None:
    """Refuse to save sharded state whose step counts differ between ranks (a non-finite gradient
    in one rank's shard skips that shard's update only): the checkpoint keeps one step per parameter."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    steps = torch.stack([optimizer.state[p]["step"].float().cpu() for p in params])
    device = local(params[0]).device if dist.get_backend() == "nccl" else torch.device("cpu")
    low, high = (-steps).to(device), steps.to(device)
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = (-low != high).nonzero().flatten().tolist()
    if differ:
        raise RuntimeError(
            f"the step counts of {len(differ)} sharded parameter(s) differ between ranks (a non-finite gradient in "
            "one rank's shard skipped only that shard's update); such state cannot be saved as one checkpoint"
        )


def _sharded_entries(optimizer, p: torch.Tensor, state: dict) -> dict:
    """A sharded parameter's state as saved: the step, and every other entry a DTensor laid out as
    ``p`` (see the module docstring)."""
    group, _ = optimizer.position(p)
    lp = local(p)
    n = lp.numel()
    out = {"step": state["step"]}
    names = {}
    for slot, codec in optimizer.codecs(p, group).items():
        names[slot] = codec.name
        if _blocked(codec):
            codes, scales = state[slot + ".codes"], state[slot + ".scales"]
            entries = {
                _ELEMENT_CODES: _unpack(codes, codec.state_bits)[:n].reshape(lp.shape),
                _ELEMENT_SCALES: scales.repeat_interleave(codec.block)[:n].reshape(lp.shape),
            }
        else:
            entries = {s: state[slot + s] for s in codec.suffixes}
        for suffix, t in entries.items():
            if t.shape != lp.shape:
                raise ValueError(
                    f"the state format {codec.name!r} of {slot!r} stores {suffix!r} as {tuple(t.shape)}, not one value "
                    f"per element of the local shard {tuple(lp.shape)}: it cannot be saved for a sharded parameter"
                )
            out[slot + suffix] = as_sharded(p, t)
    out[STATE_META] = {"codecs": names, "layout": "elementwise"}
    if MASTER_CORRECTION in state:
        out[MASTER_CORRECTION] = as_sharded(p, state[MASTER_CORRECTION])
        out[STATE_META]["dtype"] = _dtype_name(p)
    return out


def _localise(p: torch.Tensor, t):
    """A saved entry as ``p``'s local shard sees it: a DTensor's local tensor; a whole tensor of a
    sharded parameter's global shape, the shard's rows; anything else as it is."""
    if is_sharded(t):
        return local(t)
    if is_sharded(p) and isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape == p.shape:
        lp = local(p)
        return t.detach().reshape(-1).narrow(0, element_offset(p), lp.numel()).view(lp.shape)
    return t


def _blocked(codec: MomentCodec) -> bool:
    """Whether ``codec`` stores packed codes and one scale per block of ``codec.block`` elements: saved for
    a sharded parameter as a code and a scale per element (``_ELEMENT_CODES``, ``_ELEMENT_SCALES``)."""
    return tuple(codec.suffixes) == (".codes", ".scales") and hasattr(codec, "block")


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``bits`` bits, ``8 // bits`` a byte (element ``i`` at bits ``bits * i``), one a byte."""
    if bits == 8:
        return packed.reshape(-1)
    c = packed.reshape(-1)
    return torch.stack([(c >> (bits * j)) & ((1 << bits) - 1) for j in range(8 // bits)], dim=1).reshape(-1)


def _pack(codes: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    """``_unpack``'s inverse, zero-padded to ``size`` bytes."""
    per = 8 // bits
    codes = torch.nn.functional.pad(codes.reshape(-1), (0, size * per - codes.numel()))
    if bits == 8:
        return codes
    c = codes.view(-1, per)
    out = c[:, 0].clone()
    for j in range(1, per):
        out |= c[:, j] << (bits * j)
    return out


def _from_elements(p: torch.Tensor, saved: dict, names: dict, signed_of, frames: dict, where: str) -> None:
    """Rebuild the blocks of ``p``'s local shard from element-wise saved moments, in place in ``saved``:
    exactly where every block's elements share one scale, else every moment as fp32 values (each element
    decoded with its own scale, a framed one with its frame's value; re-encoded by the caller)."""
    lp = local(p)
    n = lp.numel()
    elements = {}
    for slot, name in list(names.items()):
        codes, scales = saved.pop(slot + _ELEMENT_CODES, None), saved.pop(slot + _ELEMENT_SCALES, None)
        if codes is None and scales is None:
            continue
        if name not in known_formats():
            _refuse_removed(name, slot, where)
            raise ValueError(f"state {slot!r} of {where} was saved in the state format {name!r}, unknown here")
        codec = codec_named(name, signed_of(slot), lp.shape)
        if not _blocked(codec):
            raise ValueError(f"state {slot!r} of {where} is saved element-wise but {name!r} is not a block format")
        scale_dtype = codec.layout(lp.shape)[".scales"][0]
        for what, t, dtype in (("codes", codes, torch.uint8), ("scales", scales, scale_dtype)):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != lp.shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"state {slot!r} of {where}: element-wise {what} must be {dtype} of the shard's shape "
                    f"{tuple(lp.shape)}, got {got}"
                )
        elements[slot] = codec, codes.reshape(-1), scales.reshape(-1)
    intact = all(
        torch.equal(scales[:: codec.block].repeat_interleave(codec.block)[:n], scales)
        for codec, _, scales in elements.values()
    )
    if intact:  # the blocks as they were
        for slot, (codec, codes, scales) in elements.items():
            shape = codec.layout(lp.shape)[".codes"][1]
            saved[slot + ".codes"] = _pack(codes, codec.state_bits, shape.numel()).reshape(shape)
            saved[slot + ".scales"] = scales[:: codec.block]
        return
    # another sharding split the saved blocks: each element decoded alone, frames first (exact)
    values = {}
    for slot, (codec, codes, scales) in sorted(elements.items(), key=lambda item: item[1][0].frame):
        frame = values.get(frames.get(slot)) if codec.frame else None
        if codec.frame and frame is None:
            raise ValueError(f"state {slot!r} of {where}: its frame {frames.get(slot)!r} was not saved with it")
        values[slot] = _decode_elements(codec, codes, scales, frame, slot, where, signed_of(slot))
        saved[slot] = values[slot].reshape(lp.shape)
        names.pop(slot)  # a plain fp32 value now


def _decode_elements(codec, codes: torch.Tensor, scales: torch.Tensor, frame, slot, where, signed) -> torch.Tensor:
    """Each element decoded with its own scale (and its frame's value), as its block decodes it. A block
    format's are checked first as the codec checks blocks (the values of the others are checked as
    loaded values by the caller)."""
    if hasattr(codec, "decode_elements"):
        return codec.decode_elements(codes, scales, frame)
    alone = codec_named(codec.name, signed, torch.Size([codes.numel() * codec.block]))
    spread = torch.zeros(codes.numel(), codec.block, dtype=torch.uint8, device=codes.device)
    spread[:, 0] = codes
    shape = alone.layout(alone.shape)[".codes"][1]
    stored = {".codes": _pack(spread, codec.state_bits, shape.numel()).reshape(shape), ".scales": scales}
    _refuse_invalid(alone, stored, slot, where, signed)  # decoded, such scales would pass as values
    return alone.decode(stored).float().reshape(-1, codec.block)[:, 0]


def _load_indices(meta: dict | None, ids: dict) -> dict:
    """The parameters' saved indices (saved id -> index), where the checkpoint has one for each parameter
    of the groups; {} where it has none (older checkpoints, torch.optim's, DCP's): then each keeps its own."""
    saved = meta.get("indices") if meta is not None else None
    if saved is None:
        return {}
    values = list(saved.values()) if isinstance(saved, dict) else None
    if (
        values is None
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in values)
        or len(set(values)) != len(values)
    ):
        raise ValueError(f"checkpoint has an invalid indices entry (expected distinct parameter indices): {saved!r}")
    return dict(saved) if set(saved) == set(ids) else {}


def _load_release_clipping(optimizer, meta: dict | None, ids: dict, index_of):
    """The history of clipping under release from a checkpoint, in a new ``ReleaseClipping`` (None:
    this optimizer does not clip). A checkpoint without one gives an empty history: the optimizer's
    own (DCP's template step made one of zeros) would not belong to the loaded state."""
    clipping = optimizer.gradient_pipeline.new_clipping()
    if clipping is None:
        return None
    saved = meta.get("release_clipping") if meta is not None else None
    if saved is None:
        return clipping
    indices = {pid: (index_of(pid), p.device) for pid, (p, _) in ids.items()}
    try:
        clipping.load_state_dict(saved, indices)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"checkpoint has an invalid release_clipping entry: {e!r}") from e
    return clipping


def _dtype_name(p: torch.Tensor) -> str:
    return str(p.dtype).removeprefix("torch.")


def _check_correction_dtype(p: torch.Tensor, saved_dtype, correction, where: str) -> None:
    """Refuse a non-zero master correction saved for parameters of another dtype: its steps are that
    dtype's (bf16 and fp16 heads have different grids), so read as this one's it would be wrong."""
    if saved_dtype is None or saved_dtype == _dtype_name(p) or not isinstance(correction, torch.Tensor):
        return
    if p.dtype not in (torch.bfloat16, torch.float16):
        return  # fp32 keeps no correction: convert_correction refuses a non-zero one
    if bool((correction == 0).all()):
        return
    raise ValueError(
        f"the master_correction of {where} was saved for {saved_dtype} parameters; this one is "
        f"{_dtype_name(p)}, whose master it would misread. Resume in {saved_dtype}; to change the dtype, take "
        "fusedopt.master_state_dict(model, optimizer) in the saved dtype, delete each state's 'master_correction' "
        "from the checkpoint, load it, then load those fp32 weights with fusedopt.load_master_state_dict"
    )


def _codec_names(optimizer, p: torch.Tensor) -> dict[str, str]:
    state = optimizer.state.get(p)
    if not state:
        return {}
    group, _ = optimizer.position(p)
    return {slot: codec.name for slot, codec in optimizer.codecs(p, group).items()}


def load_state_dict(optimizer, saved: dict, pre_hooks: dict, post_hooks: dict) -> None:
    """Load ``saved`` into ``optimizer`` (see the module docstring); all-or-nothing. ``pre_hooks``,
    ``post_hooks``: the optimizer's ``register_load_state_dict_pre_hook`` / ``_post_hook`` hooks."""
    saved = saved.copy()
    for hook in pre_hooks.values():
        result = hook(optimizer, saved)
        if result is not None:
            saved = result

    meta = saved.get("fusedopt")
    folded = meta is None  # through DCP: the entry is rebuilt from the copies it keeps
    if folded:
        meta = _unfold_from_dcp(saved["param_groups"])
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
    interrupted = _load_interrupted(meta) if meta is not None else None
    shapes = meta.get("shapes", {}) if meta is not None else {}
    codec_names = meta.get("codecs", {}) if meta is not None else {}
    dtypes = meta.get("dtypes", {}) if meta is not None else {}  # (not in checkpoints before it was kept)
    saved_format = meta.get("format", 0) if meta is not None else None  # None: not fusedopt's
    lossy: list[str] = []
    new_state: defaultdict = defaultdict(dict)
    ids = {pid: (p, g) for g, s in zip(new_groups, saved_groups) for pid, p in zip(s["params"], g["params"])}
    indices = _load_indices(meta, ids)

    def index_of(pid) -> int:
        return indices[pid] if pid in indices else optimizer.param_index(ids[pid][0])

    for pid, param_state in saved["state"].items():
        if pid not in ids:
            raise ValueError(f"loaded state dict has state for parameter id {pid!r}, which no group lists")
        p, group = ids[pid]
        index = index_of(pid)
        where = f"parameter {index} (shape {tuple(p.shape)})"
        names = codec_names.get(pid, {})
        saved_dtype = dtypes.get(pid)
        if isinstance(param_state, dict) and not param_state:
            continue  # an empty entry: no state (torch.optim saves one where opt.state[p] was read)
        if isinstance(param_state, dict) and (STATE_META in param_state or is_sharded(p)):
            param_state = {k: _localise(p, v) for k, v in param_state.items()}
            meta_p = param_state.pop(STATE_META, None)
            if isinstance(meta_p, dict):
                names = dict(meta_p.get("codecs", {}))
                saved_dtype = meta_p.get("dtype", saved_dtype)
                history = meta_p.get("release_clipping")
                if folded and meta is not None and "release_clipping" in meta and history is not None:
                    meta["release_clipping"]["params"][pid] = _unfold_history(history)
                if meta_p.get("layout") == "elementwise":
                    signed_of = lambda slot: slot not in optimizer.nonnegative_slots  # noqa: E731
                    _from_elements(p, param_state, names, signed_of, optimizer.frames, where)
        if pid in shapes and list(shapes[pid]) != list(p.shape):
            raise ValueError(
                f"loaded state dict holds the state of a parameter of shape {tuple(shapes[pid])} for {where}: the "
                "parameters are not the ones it was saved from (another model, or another order)"
            )
        if isinstance(param_state, dict):
            _check_correction_dtype(p, saved_dtype, param_state.get(MASTER_CORRECTION), where)
        new_state[p] = _convert_param_state(
            optimizer, p, group, param_state, where, seed, index, lossy, saved_format, names
        )

    clipping = _load_release_clipping(optimizer, meta, ids, index_of)

    # Everything validated and converted: commit (the shared corrections are built, if they were
    # not, before the first one is overwritten).
    for p, state in new_state.items():
        optimizer.share_correction(p, state, new_groups)
    for i, group in enumerate(new_groups):
        groups[i] = group
    if indices:
        optimizer.restore_indices({id(ids[pid][0]): index for pid, index in indices.items()})
    optimizer.state = new_state
    optimizer.seed = seed
    if skipped is not None:
        optimizer.num_skipped_updates.copy_(skipped)
    if interrupted is not None:
        optimizer.num_interrupted_steps = interrupted
    if clipping is not None:
        optimizer.gradient_pipeline.replace_clipping(clipping)
    if lossy:
        warnings.warn(
            "checkpoint state was converted to this optimizer's state format with rounding: " + "; ".join(lossy),
            stacklevel=3,
        )
    for hook in post_hooks.values():
        hook(optimizer)


def _merge_group(optimizer, group: dict, saved_group: dict) -> dict:
    merged = dict(group)
    for key, value in saved_group.items():
        if key in ("params", STATE_META) or key in _IGNORED_FOREIGN_KEYS:
            continue  # (STATE_META: fusedopt's optimizer-wide entry, folded for DCP)
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


def _load_interrupted(meta: dict) -> int:
    """The count of steps whose backward pass stopped early (0 in checkpoints from before it was kept)."""
    counter = meta.get("num_interrupted_steps", 0)
    if isinstance(counter, torch.Tensor) and not counter.is_floating_point() and counter.numel() == 1:
        counter = int(counter)
    if isinstance(counter, int) and not isinstance(counter, bool) and counter >= 0:
        return counter
    raise ValueError(f"checkpoint has an invalid num_interrupted_steps: {counter!r} (expected an integer count)")


def _convert_param_state(
    optimizer, p, group, saved: dict, where: str, seed: int, index: int, lossy: list, saved_format: int | None, names
) -> dict:
    if not isinstance(saved, dict):
        raise ValueError(f"state of {where} is a {type(saved).__name__}, expected a dict")
    saved = {k: v for k, v in saved.items() if v is not None}  # torch.optim.SGD saves momentum_buffer=None
    codecs: dict[str, MomentCodec] = optimizer.codecs(p, group)
    first = optimizer.element_offset(p)
    p = local(p)  # a sharded parameter's state covers its local shard
    # Master-weight correction: copied, widened, or zero when absent (master = the loaded bf16 value).
    correction = convert_correction(p, group["master_weight_bits"], saved.pop(MASTER_CORRECTION, None), where)
    known = {"step"} | {slot + s for slot, codec in codecs.items() for s in codec.layout(p.shape)}
    foreign_slots = {k for k in saved if k not in known and not any(_of_slot(k, slot) for slot in codecs)}
    if foreign_slots:
        raise ValueError(f"state of {where} has entries this optimizer does not keep: {sorted(foreign_slots)}")

    step = _load_step(saved.get("step"), where, has_moments=any(k != "step" for k in saved), optimizer=optimizer)
    out = {"step": torch.tensor(step, dtype=torch.float32, device=p.device)}
    check_draws(codecs)
    # re-encoding rounds like an update
    draws = rng.UpdateDraws(seed, index, out["step"], p, group["master_weight_bits"], first, first_draws_whole(codecs))
    signed_of = {slot: slot not in optimizer.nonnegative_slots for slot in codecs}
    sources = {
        slot: _saved_codec(slot, saved, p.shape, signed_of[slot], saved_format, names.get(slot), where)
        for slot in codecs
    }
    saved_values: dict[str, torch.Tensor] = {}
    copied, stored_out = set(), {}
    # frames first: a framed moment is encoded in units of its frame as now stored
    order = sorted(enumerate(codecs.items()), key=lambda item: item[1][1].frame)
    for i, (slot, codec) in order:
        layout = codec.layout(p.shape)
        entries = {s: saved.get(slot + s) for s in layout}
        source = sources[slot]
        same_format = source is None or source is _PLAIN or source.name == codec.name
        same_frame = not codec.frame or optimizer.frames.get(slot) in copied
        if (
            same_format
            and same_frame
            and all(isinstance(t, torch.Tensor) and (t.dtype, t.shape) == layout[s] for s, t in entries.items())
        ):
            _refuse_invalid(codec, entries, slot, where, signed_of[slot])
            out.update({slot + s: t.detach() for s, t in entries.items()})  # copied to p.device by pack_tensors
            stored_out[slot] = {s: t.detach().to(p.device) for s, t in entries.items()}
            copied.add(slot)
            continue
        value = saved.get(slot)
        if value is None and not any(_of_slot(k, slot) for k in saved):
            if step != 0:
                raise ValueError(f"state of {where} lacks {slot!r} although it was updated {step:g} times")
            stored_out[slot] = codec.zeros(p.shape, p.device)
            out.update({slot + s: t for s, t in stored_out[slot].items()})
            continue
        if source is None:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            target = codec.name
            raise ValueError(f"state {slot!r} of {where} cannot be converted to the state format {target!r}: got {got}")
        decoded = _saved_value(slot, saved_values, sources, signed_of, saved, p.device, optimizer.frames, where)
        origin = str(value.dtype) if source is _PLAIN else source.name
        frame = {}
        if codec.frame:
            frame_slot = optimizer.frames[slot]
            frame = {"frame": codecs[frame_slot].decode(stored_out[frame_slot])}
        encoded = codec.encode(decoded, draws.moment(i, codec.whole_word), **frame)
        stored_out[slot] = encoded
        error = (codec.decode(encoded, **frame) - decoded).abs().max().item() if decoded.numel() else 0.0
        if error > 0:
            scale = decoded.abs().max().item()
            change = f"{origin} -> {codec.name}"
            lossy.append(f"{slot} of {where}: {change}, max abs error {error:.3g} (max |x| {scale:.3g})")
        out.update({slot + s: t for s, t in encoded.items()})
    out.update(correction)
    step_tensor = out.pop("step")
    return {"step": step_tensor, **pack_tensors(out, p.device)}  # shared allocations, as a fresh state


def _saved_value(
    slot: str, values: dict, sources: dict, signed_of: dict, saved: dict, device, frames: dict, where: str
) -> torch.Tensor:
    """The saved moment of ``slot`` decoded by its saved codec (a framed one with its saved frame),
    kept in ``values``; storage or a decoded value no encode gives is refused. A function of the module,
    not a recursive closure: that would be a reference cycle holding the optimizer (and the loaded
    tensors) until the garbage collector ran."""
    if slot not in values:
        source = sources.get(slot)
        if source is None:
            raise ValueError(f"state {slot!r} of {where} is missing: a saved moment is stored relative to it")
        stored = {s: saved[slot + s].detach().to(device) for s in source.suffixes}
        _refuse_invalid(source, stored, slot, where, signed_of[slot])
        frame = {}
        if source.frame:
            frame["frame"] = _saved_value(frames[slot], values, sources, signed_of, saved, device, frames, where)
        values[slot] = source.decode(stored, **frame).float()
        if source.suffixes != ("",):  # valid storage decodes validly, but a frame of another format may not
            problems = value_problems(values[slot], signed_of[slot])
            if problems:
                problem = "; ".join(problems)
                raise ValueError(f"state {slot!r} of {where} ({source.name}) is corrupt: decoded, {problem}")
    return values[slot]


def _refuse_invalid(codec: MomentCodec, stored: dict, slot: str, where: str, signed: bool) -> None:
    """Refuse a saved moment whose storage its codec could not have written (``MomentCodec.invalid``;
    ``signed=False``: the slot's moment is never negative)."""
    problem = codec.invalid(stored, signed=signed)
    if problem is not None:
        raise ValueError(f"state {slot!r} of {where} ({codec.name}) is corrupt: {problem}")


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
        if name not in known_formats():
            _refuse_removed(name, slot, where)
            raise ValueError(
                f"state {slot!r} of {where} was saved in the state format {name!r}, which this fusedopt does not "
                f"know (known: {', '.join(known_formats())})"
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
    for candidate_name in ("block8", "block4"):
        candidate = codec_named(candidate_name, signed, torch.Size(shape))
        layout = candidate.layout(shape)
        if all(_fits(saved.get(slot + s), dtype, size) for s, (dtype, size) in layout.items()):
            if candidate_name == "block8" and saved_format is not None and saved_format <= 1:
                # format 1 stored 8-bit moments on square levels, in block8's layout
                _refuse_removed("block8-square", slot, where)
            return candidate
    return None


def _refuse_removed(name: str, slot: str, where: str) -> None:
    """Raise the removed format's error if ``name`` is one (``fusedopt.codecs.REMOVED_FORMATS``)."""
    error = removed_format_error(name, f"state {slot!r} of {where} was saved in the state format {name!r}, which")
    if error is not None:
        raise error


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _fits(t, dtype: torch.dtype, shape: torch.Size) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape


class _PlainCodec(MomentCodec):
    """Any floating tensor under the slot's own name (decoded to fp32)."""

    name = "plain"

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
    name = type(optimizer).__name__
    if optimizer.torch_group_keys is None:
        raise ValueError(f"torch.optim has no counterpart of fusedopt.{name}")
    for i, group in enumerate(optimizer.param_groups):
        lacked = [key for key in optimizer.torch_lacks if group.get(key) is not None]
        if lacked:
            raise ValueError(
                f"param_groups[{i}] sets {', '.join(f'{k}={group[k]!r}' for k in lacked)}, which torch.optim.{name} "
                "does not have: it would drop their state and train without them. Keep the fusedopt state_dict()"
            )
    packed = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, p in enumerate(params):
        if p not in optimizer.state or not optimizer.state[p]:
            continue
        group, _ = optimizer.position(p)
        saved = optimizer.state[p]
        entry = {"step": saved["step"].detach().clone().cpu()}
        codecs = optimizer.codecs(p, group)
        stored = {slot: {s: saved[slot + s] for s in codec.suffixes} for slot, codec in codecs.items()}
        for slot, value in decode_moments(codecs, stored, optimizer.frames).items():
            entry[slot] = value.detach().float().clone()
        if not optimizer.torch_saves_step:
            entry.pop("step")
            for slot in optimizer.slots:
                entry.setdefault(slot, None)
        state[index] = entry
    fusedopt_only = ("state_bits", "state_format", "master_weight_bits", "min_compress_numel", STATE_META)
    groups = []
    for group in packed["param_groups"]:
        torch_group = {k: v for k, v in group.items() if k not in fusedopt_only}
        torch_group.update(optimizer.torch_group_keys)
        groups.append(torch_group)
    return {"state": state, "param_groups": groups}
