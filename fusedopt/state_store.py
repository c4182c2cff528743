"""Per-parameter bookkeeping of one optimizer: where each parameter is, and its state.

``StateStore`` knows each parameter's group and index (the index is a hash input of stochastic
rounding: it never changes or repeats), a sharded parameter's first global element and the process
groups its gradient is split over, and creates and checks each parameter's state tensors. The state
itself stays in ``optimizer.state`` (torch's dict, which checkpoints replace); the codecs come from
``optimizer.codecs`` (an algorithm may override it).

Positions are keyed by ``id(param)`` and hold each parameter weakly: a parameter taken out of
``param_groups`` behind the optimizer's back (accelerate's ``prepare()`` swapping in FSDP2's sharded
parameters drops the unsharded ones, which FSDP2 has just moved to the GPU) is freed at once, not
kept until the next ``sync``. A parameter that dies leaves a mark (``_gone``), so the next sync looks
at every group again even where the lists kept their lengths and ids.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .codecs import codec_for, codec_named
from .master import MASTER_CORRECTION, correction_layout, master_value
from .sharding import as_sharded, element_offset, is_sharded, local, shard_groups
from .state_memory import SharedCorrections, pack

# A parameter's entry: (group index, param index, the parameter weakly, its shape when last seen).
# The shape tells what a replacement must match once the parameter itself is gone.
Entry = tuple


@dataclass
class Replacement:
    """A parameter found where another one stood at the last sync (same group, same position), which
    is no longer in any group: it takes over that one's index and state (``StateStore.plan``)."""

    new: torch.Tensor
    old: torch.Tensor | None  # None: the parameter it replaces is gone (freed)
    entry: Entry  # the replaced parameter's entry
    group_index: int
    position: int


@dataclass
class SyncPlan:
    """What ``StateStore.plan`` found: the groups as they are now, and the replacements in them."""

    groups: list
    known: dict  # id(param) -> its entry, for every parameter still held
    replacements: list[Replacement] = field(default_factory=list)


class StateStore:
    """Positions and state of one optimizer's parameters (see the module docstring)."""

    def __init__(self, optimizer):
        # the owner, for its state, param_groups and codecs; weakly, so that dropping it frees it (and
        # removes its release hooks) at once, not at the next cycle collection. It never outlives its owner.
        self._opt = weakref.ref(optimizer)
        self._position: dict[int, Entry] = {}  # id(param) -> its entry (see Entry)
        self._next_index = 0  # a new parameter's index (a hash input: it never changes or repeats)
        self._offsets: dict[torch.Tensor, int] = {}  # sharded param -> its shard's first global element index
        self._shard_groups: dict[torch.Tensor, tuple] = {}  # sharded param -> groups its shards span
        self._groups_seen: list = []  # (id(group), id(its params list), its length) as the last sync saw them
        # id(group) -> (the group, its params list, its parameters' entries by position) at the last sync
        # or add(), in the order of param_groups then. Holding the group and the list keeps their ids
        # their own, so that _groups_seen cannot match a new dict or list made where one was freed
        self._layout: dict[int, tuple[dict, list, tuple[Entry, ...]]] = {}
        self._gone: list = []  # weak references of held parameters that died (their callback appends them)
        self._stale = False  # a lookup found a parameter the last sync did not see: look at every group again
        self.corrections = SharedCorrections()

    # --- positions -------------------------------------------------------------------------

    def _entry(self, p: torch.Tensor, group_index: int, index: int, ref=None) -> Entry:
        if ref is None:
            ref = weakref.ref(p, self._gone.append)  # the list, not self: no reference cycle
        return group_index, index, ref, p.shape

    def add(self, group_index: int, params) -> None:
        """Give each parameter of a new group its position (a new index each)."""
        entries = []
        for p in params:
            entry = self._entry(p, group_index, self._next_index)
            self._position[id(p)] = entry
            entries.append(entry)
            self._next_index += 1
        group = self._opt().param_groups[group_index]
        self._layout[id(group)] = group, group["params"], tuple(entries)

    def restore_indices(self, indices: dict[int, int]) -> None:
        """Give parameters (by id) the indices a checkpoint saved for them; new parameters count on above
        every index in use."""
        self._position = {key: (e[0], indices.get(key, e[1]), e[2], e[3]) for key, e in self._position.items()}
        self._layout = {
            gid: (group, params, tuple(self._position.get(id(e[2]()), e) for e in entries))
            for gid, (group, params, entries) in self._layout.items()
        }
        self._next_index = max([self._next_index, *(e[1] + 1 for e in self._position.values())])

    def _before(self, group_index: int, group: dict, groups: set[int]) -> tuple[Entry, ...]:
        """The entries of ``group``'s parameters, by position, at the last sync: those of the same group
        dict, or, where the dict is a new one, those of the dict that stood at its index then and is in
        no group now (``load_state_dict`` replaces every dict, as accelerate's preparation does through
        it). ``groups``: the ids of the group dicts now."""
        layout = self._layout.get(id(group))
        if layout is None and group_index < len(self._layout):
            layout = list(self._layout.values())[group_index]
            if id(layout[0]) in groups:
                layout = None  # that dict is still there (moved): this one is another group
        return () if layout is None else layout[2]

    def plan(self, param_groups: list[dict]) -> SyncPlan | None:
        """Follow edits of ``param_groups`` (``FusedOptimizer.sync_groups``), first step: find each
        parameter's entry again, and each replacement (see ``Replacement``). Changes nothing; returns
        None when the groups did not change. A parameter that is neither held nor a replacement, or a
        replacement of another shape, or one whose state cannot follow, is refused with a ValueError.

        The check that nothing changed is per group (its dict, its list, its length) plus the mark a
        freed parameter leaves; a list edited in place while the parameter taken out lives on is
        seen when the new one is first looked up (``_find``)."""
        seen = [(id(g), id(g["params"]), len(g["params"])) for g in param_groups]
        if seen == self._groups_seen and not self._gone and not self._stale:
            return None
        known, listed, unknown = {}, set(), []
        for group_index, group in enumerate(param_groups):
            for position, p in enumerate(group["params"]):
                key = id(p)
                if key in listed:
                    raise ValueError(_not_added(group_index, p))
                listed.add(key)
                entry = self._position.get(key)
                if entry is not None and entry[2]() is p:
                    known[key] = entry
                else:
                    unknown.append((group_index, position, p))
        plan = SyncPlan(param_groups, known)
        opt = self._opt()
        groups = {id(g) for g in param_groups}
        for group_index, position, p in unknown:
            group = param_groups[group_index]
            before = self._before(group_index, group, groups)
            if len(before) != len(group["params"]):
                raise ValueError(_not_added(group_index, p))  # not the group it was, or it grew or shrank
            entry = before[position]
            old = entry[2]()
            if old is not None and id(old) in listed:
                raise ValueError(_not_added(group_index, p))  # the one there before is still held: p is new
            shape = entry[3] if old is None else old.shape
            if p.shape != shape:
                raise ValueError(
                    f"param_groups[{group_index}]['params'][{position}] was replaced by a parameter of shape "
                    f"{tuple(p.shape)} where one of shape {tuple(shape)} stood: a parameter put in place of another "
                    "(as accelerate's prepare() puts each FSDP2-sharded parameter in place of the unsharded one) "
                    "takes over its index and state only with the same (global) shape. Add other parameters with "
                    "add_param_group()"
                )
            if opt.state.get(p):
                raise ValueError(
                    f"param_groups[{group_index}]['params'][{position}] was replaced by a parameter of shape "
                    f"{tuple(p.shape)} that already has optimizer state of its own: it cannot take over the state "
                    "of the parameter it replaces"
                )
            if old is not None and opt.state.get(old):
                problem = _layout_change(old, p)
                if problem is not None:
                    raise ValueError(
                        f"param_groups[{group_index}]['params'][{position}] was replaced by {_describe(p)} where "
                        f"{_describe(old)} stood, which has optimizer state already: the state was laid out for the "
                        f"old parameter ({problem}), and fusedopt moves state only to a parameter laid out the same. "
                        "Replace parameters before the first step (accelerate's prepare() does), or save a "
                        "checkpoint and load it into an optimizer built on the new parameters (a sharded "
                        "checkpoint through torch.distributed.checkpoint reshards the state)"
                    )
            plan.replacements.append(Replacement(p, old, entry, group_index, position))
        return plan

    def commit(self, plan: SyncPlan) -> tuple[list[torch.Tensor], list[int]]:
        """Apply ``plan`` (checked by the optimizer): each held parameter in its group now, each
        replacement with the index, and the state if any, of the parameter it replaces. Returns the
        parameters no longer in any group (forgotten here, their state left in ``optimizer.state`` as
        torch.optim leaves it) and the ids of those freed already."""
        replaced = {id(r.new): r for r in plan.replacements}
        positions, layout = {}, {}
        for group_index, group in enumerate(plan.groups):
            entries = []
            for p in group["params"]:
                key = id(p)
                entry = plan.known.get(key)
                if entry is None:
                    r = replaced[key]
                    entry = self._entry(p, group_index, r.entry[1])
                    if r.old is not None:
                        self._hand_over(r.old, p)
                else:
                    entry = self._entry(p, group_index, entry[1], entry[2])
                positions[key] = entry
                entries.append(entry)
            layout[id(group)] = group, group["params"], tuple(entries)
        dropped, gone = [], []
        for key, entry in self._position.items():
            p = entry[2]()
            if p is None:
                gone.append(key)  # (its id may be a new parameter's already)
            elif key not in positions or positions[key][2]() is not p:
                dropped.append(p)
                self._offsets.pop(p, None)
                self._shard_groups.pop(p, None)
        self._position, self._layout = positions, layout
        self._groups_seen = [(id(g), id(g["params"]), len(g["params"])) for g in plan.groups]
        self._gone.clear()
        self._stale = False
        return dropped, gone

    def _hand_over(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Move ``old``'s state (checked by ``plan`` to fit ``new``) to ``new``. A master correction that
        is a view of the shared buffer stays that view; ``self.corrections`` still lists it under
        ``old`` (it has no way to rename an entry), so a checkpoint loaded later gives ``new`` a
        correction of its own."""
        opt = self._opt()
        state = opt.state.pop(old, None)
        if state:
            opt.state[new] = state

    def _find(self, p: torch.Tensor) -> Entry:
        """``p``'s entry, where the look-up in ``_position`` found none or a held parameter died since the
        last sync (the look-ups below do that part inline: they run in every release hook). A parameter
        the last sync did not see (a group's list edited in place since, the parameter taken out still
        alive) syncs first, as the next step would."""
        entry = self._look_again(p)
        if entry is None:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is not a parameter of this optimizer")
        return entry

    def _look_again(self, p: torch.Tensor) -> Entry | None:
        """Sync every group (``FusedOptimizer.sync_groups``: replacements are checked, hooked), then
        ``p``'s entry (None: ``p`` is not a parameter of the optimizer)."""
        self._stale = True
        self._opt().sync_groups()
        entry = self._position.get(id(p))
        return entry if entry is not None and entry[2]() is p else None

    def holds(self, p) -> bool:
        """Whether ``p`` is a parameter of the optimizer."""
        if not isinstance(p, torch.Tensor):
            return False
        entry = self._position.get(id(p))
        if entry is None or self._gone:
            entry = self._look_again(p)
        return entry is not None and entry[2]() is p

    def position(self, p: torch.Tensor) -> tuple[dict, int]:
        """The group holding ``p`` and ``p``'s index in the optimizer (a hash input)."""
        entry = self._position.get(id(p))
        if entry is None or self._gone:
            entry = self._find(p)
        return self._opt().param_groups[entry[0]], entry[1]

    def group_index(self, p: torch.Tensor) -> int:
        """The index in ``param_groups`` of the group holding ``p``."""
        entry = self._position.get(id(p))
        if entry is None or self._gone:
            entry = self._find(p)
        return entry[0]

    def param_index(self, p: torch.Tensor) -> int:
        """``p``'s index in the optimizer: a hash input, it never repeats (a checkpoint's load restores the
        saved ones)."""
        entry = self._position.get(id(p))
        if entry is None or self._gone:
            entry = self._find(p)
        return entry[1]

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


def _not_added(group_index: int, p: torch.Tensor) -> str:
    return (
        f"param_groups[{group_index}]['params'] holds a parameter of shape {tuple(p.shape)} that was not added "
        "through the constructor or add_param_group() (or is listed twice); add parameters with "
        "add_param_group(). A parameter put in place of another one (same group, same position, same shape, "
        "the other one no longer in any group) takes over its index and state"
    )


def _describe(p: torch.Tensor) -> str:
    """A parameter's layout in words, for errors."""
    if is_sharded(p):
        return (
            f"a {p.dtype} shard of shape {tuple(local(p).shape)} (placements {tuple(p.placements)}) of a parameter "
            f"of shape {tuple(p.shape)} on {local(p).device}"
        )
    return f"a {p.dtype} parameter of shape {tuple(p.shape)} on {p.device}"


def _layout_change(old: torch.Tensor, new: torch.Tensor) -> str | None:
    """How ``new`` is laid out differently from ``old`` for the optimizer state (None: the same: the
    same dtype, shape and device, and where sharded the same placements, mesh and local shard)."""
    if new.dtype != old.dtype:
        return f"dtype {old.dtype}, now {new.dtype}"
    if is_sharded(new) != is_sharded(old):
        return "sharded, now whole" if is_sharded(old) else "whole, now a shard"
    lo, ln = local(old), local(new)
    if ln.shape != lo.shape or ln.device != lo.device:
        return f"local shape {tuple(lo.shape)} on {lo.device}, now {tuple(ln.shape)} on {ln.device}"
    if is_sharded(new):
        if tuple(new.placements) != tuple(old.placements) or new.device_mesh != old.device_mesh:
            return "another device mesh or placements"
        if element_offset(new) != element_offset(old):
            return "a shard starting at another element"
    return None
