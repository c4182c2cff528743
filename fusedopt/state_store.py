"""Per-parameter bookkeeping of one optimizer: where each parameter is, and its state.

``StateStore`` knows each parameter's group and index (the index is a hash input of stochastic
rounding: it never changes or repeats), a sharded parameter's first global element and the process
groups its gradient is split over, and creates and checks each parameter's state tensors. The state
itself stays in ``optimizer.state`` (torch's dict, which checkpoints replace); the codecs come from
``optimizer.codecs`` (an algorithm may override it).
"""

from __future__ import annotations

import weakref

import torch

from .codecs import codec_for, codec_named
from .master import MASTER_CORRECTION, correction_layout, master_value
from .sharding import as_sharded, element_offset, is_sharded, local, shard_groups
from .state_memory import SharedCorrections, pack


class StateStore:
    """Positions and state of one optimizer's parameters (see the module docstring)."""

    def __init__(self, optimizer):
        # the owner, for its state, param_groups and codecs; weakly, so that dropping it frees it (and
        # removes its release hooks) at once, not at the next cycle collection. It never outlives its owner.
        self._opt = weakref.ref(optimizer)
        self._position: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (group index, param index)
        self._next_index = 0  # a new parameter's index (a hash input: it never changes or repeats)
        self._offsets: dict[torch.Tensor, int] = {}  # sharded param -> its shard's first global element index
        self._shard_groups: dict[torch.Tensor, tuple] = {}  # sharded param -> groups its shards span
        self._groups_seen: list = []  # param_groups as _position last saw them (sync)
        self.corrections = SharedCorrections()

    # --- positions -------------------------------------------------------------------------

    def add(self, group_index: int, params) -> None:
        """Give each parameter of a new group its position (a new index each)."""
        for p in params:
            self._position[p] = (group_index, self._next_index)
            self._next_index += 1

    def sync(self, param_groups: list[dict]) -> list[torch.Tensor] | None:
        """Follow edits of ``param_groups`` (``FusedOptimizer.sync_groups``): find each parameter's
        group again, keeping its index. Returns the parameters no longer in any group (forgotten here),
        or None when the groups did not change."""
        seen = [(id(g), len(g["params"])) for g in param_groups]
        if seen == self._groups_seen:
            return None
        positions = {}
        for group_index, group in enumerate(param_groups):
            for p in group["params"]:
                if p not in self._position or p in positions:
                    raise ValueError(
                        f"param_groups[{group_index}]['params'] holds a parameter of shape {tuple(p.shape)} that "
                        "was not added through the constructor or add_param_group() (or is listed twice); "
                        "add parameters with add_param_group()"
                    )
                positions[p] = (group_index, self._position[p][1])
        dropped = [p for p in self._position if p not in positions]
        self._position, self._groups_seen = positions, seen
        return dropped

    def holds(self, p) -> bool:
        """Whether ``p`` is a parameter of the optimizer."""
        return isinstance(p, torch.Tensor) and p in self._position

    def position(self, p: torch.Tensor) -> tuple[dict, int]:
        """The group holding ``p`` and ``p``'s index in the optimizer (a hash input)."""
        group_index, index = self._position[p]
        return self._opt().param_groups[group_index], index

    def group_index(self, p: torch.Tensor) -> int:
        """The index in ``param_groups`` of the group holding ``p``."""
        return self._position[p][0]

    def param_index(self, p: torch.Tensor) -> int:
        """``p``'s index in the optimizer: a hash input, it never changes or repeats."""
        return self._position[p][1]

    def element_offset(self, p: torch.Tensor) -> int:
        """The global index of the first element of ``p``'s local shard (0 unless ``p`` is sharded)."""
        if not is_sharded(p):
            return 0
        offset = self._offsets.get(p)
        if offset is None:
            offset = self._offsets[p] = element_offset(p)
        return offset

    def shard_groups(self, p: torch.Tensor) -> tuple:
        """The process groups over which ``p``'s gradient is split in shards (empty: each rank has all of it)."""
        if not is_sharded(p):
            return ()
        groups = self._shard_groups.get(p)
        if groups is None:
            groups = self._shard_groups[p] = shard_groups(p)
        return groups

    # --- state tensors ---------------------------------------------------------------------

    def ensure(self, p: torch.Tensor) -> dict:
        """The state of ``p``, created (step 0, zero moments) on first use (of its local shard's
        shape for a sharded parameter)."""
        opt = self._opt()
        state = opt.state[p]
        if not state:
            group, _ = self.position(p)
            lp = local(p)
            state["step"] = torch.zeros((), dtype=torch.float32, device=lp.device)
            entries = {}  # tensors of one dtype share an allocation (state_memory.py says why)
            for slot, codec in opt.codecs(p, group).items():
                # a zero state is one value repeated (a format may store a padded block for one element)
                unit = codec.zeros(torch.Size([1]), lp.device)
                for suffix, (dtype, shape) in codec.layout(lp.shape).items():
                    entries[slot + suffix] = (dtype, shape, unit[suffix].reshape(-1)[0])
            shared = {}
            for key, (dtype, shape) in correction_layout(lp, group["master_weight_bits"]).items():
                view = self.corrections.view(p, dtype, shape, self._correction_members)
                if view is not None:
                    shared[key] = view.zero_()
                else:
                    entries[key] = (dtype, shape, None)  # zeros
            state.update(pack(entries, lp.device))
            state.update(shared)
        return state

    def _correction_members(self, groups: list[dict] | None = None):
        """(parameter, dtype, shape) of every parameter whose group keeps a master-weight correction."""
        for group in self._opt().param_groups if groups is None else groups:
            for q in group["params"]:
                for dtype, shape in correction_layout(local(q), group["master_weight_bits"]).values():
                    yield q, dtype, shape

    def share_correction(self, p: torch.Tensor, state: dict, groups: list[dict]) -> None:
        """Move a loaded state's correction into ``p``'s shared view (checkpoint loading, at commit,
        under the loaded ``groups``: their master_weight_bits decide the dtypes)."""
        value = state.get(MASTER_CORRECTION)
        if value is not None:
            view = self.corrections.view(p, value.dtype, value.shape, lambda: self._correction_members(groups))
            if view is not None and view is not value:
                state[MASTER_CORRECTION] = view.copy_(value)

    def master_weight(self, p) -> torch.Tensor:
        """``FusedOptimizer.master_weight``: ``p``'s full-precision master as a new fp32 tensor."""
        if not self.holds(p):
            raise ValueError("master_weight(p): p is not a parameter of this optimizer")
        group, _ = self.position(p)
        master = master_value(local(p), self._opt().state.get(p), group["master_weight_bits"])
        return as_sharded(p, master) if is_sharded(p) else master

    def check(self, p: torch.Tensor, group: dict) -> None:
        """Refuse state that does not fit ``p`` and its group as they are now: every tensor their
        settings need, of its dtype and shape, and no master correction they do not keep. The
        state was made for them as they were: ``p.data`` of another shape or dtype, or a group's
        ``state_bits``, ``state_format``, ``min_compress_numel``, ``master_weight_bits`` (or SGD's
        momentum) set since, would read it wrongly."""
        opt = self._opt()
        state = opt.state.get(p)
        if not state:
            return  # created from the group's settings at the first update
        lp = local(p)  # a sharded parameter's state covers its local shard
        needed = {
            slot + suffix: layout
            for slot, codec in opt.codecs(p, group).items()
            for suffix, layout in codec.layout(lp.shape).items()
        }
        needed.update(correction_layout(lp, group["master_weight_bits"]))
        problems = [_state_problem(key, state.get(key), *layout) for key, layout in needed.items()]
        if MASTER_CORRECTION in state and MASTER_CORRECTION not in needed:
            bits = group["master_weight_bits"]
            problems.append(f"holds a master_correction that master_weight_bits={bits} does not keep")
        problem = next((problem for problem in problems if problem is not None), None)
        if problem is not None:
            raise ValueError(
                f"the optimizer state of a {p.dtype} parameter of shape {tuple(p.shape)} {problem}: it was made for "
                "the parameter and its group as they were. The parameter's shape or dtype, or its group's "
                "state_bits, state_format, min_compress_numel, master_weight_bits or momentum, changed since. Change "
                "the group's settings through state_dict() / load_state_dict(), which converts the state (edit the "
                "saved group); for a parameter of another shape or dtype, build a new optimizer"
            )


def slot_codecs(p: torch.Tensor, group: dict, slots: tuple[str, ...], nonnegative: tuple[str, ...]) -> dict:
    """Slot name -> codec for parameter ``p`` under ``group`` (``FusedOptimizer.codecs``)."""
    bits, fmt, numel = group["state_bits"], group.get("state_format"), group["min_compress_numel"]
    # a sharded parameter's format is chosen from its global shape (it does not depend on the
    # number of ranks), its codec made for the local shard
    codecs = {slot: codec_for(bits, p.shape, numel, signed=slot not in nonnegative, state_format=fmt) for slot in slots}
    if is_sharded(p):
        shape = local(p).shape
        codecs = {slot: codec_named(c.name, slot not in nonnegative, shape) for slot, c in codecs.items()}
    return codecs


def _state_problem(key: str, value: torch.Tensor | None, dtype: torch.dtype, shape: torch.Size) -> str | None:
    """What is wrong with the state entry ``key`` against the (dtype, shape) needed (None: nothing)."""
    if value is None:
        return f"has no '{key}'"
    if value.dtype != dtype or value.shape != shape:
        return f"holds '{key}' as {value.dtype} {tuple(value.shape)}, not {dtype} {tuple(shape)}"
    return None
