"""Sharded parameters: FSDP2 (``fully_shard``) and the FSDP2-based ``replicate``.

Their parameters and gradients are DTensors. An update runs on the local tensors (``to_local()``):
the optimizer state of a sharded parameter is plain tensors of its local shard's shape, keyed by
the DTensor parameter, and the kernel and the reference see ordinary tensors. Only layouts whose
local shard is one contiguous range of the parameter's row-major elements are taken: every mesh
dimension ``Shard(0)`` or ``Replicate()``. Each shard then knows its first element's index in the
whole parameter (``element_offset``); the random draws of stochastic rounding are indexed by the
global element index, so they do not depend on the number of ranks.

A hook sees only its rank's shard of a gradient. What needs the whole gradient (its norm, for
clipping; whether it is finite, for skipping it) comes from one all-reduce of the shard's squared
norm over the ranks that shard it (``shard_groups``): the mesh dimensions placed ``Shard(0)``. A
``Replicate()`` dimension holds copies of the same reduced gradient, which must not be counted twice.

Checkpoints (``torch.distributed.checkpoint``) hold every state entry of a sharded parameter as a
DTensor of the parameter's global shape and placements, so DCP can reshard it (``checkpoint.py``).
"""

from __future__ import annotations

import math

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed support
    DTensor = None


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient of FSDP2 or another DTensor API)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the tensor itself otherwise), without an autograd edge."""
    if DTensor is None or not isinstance(t, DTensor):
        return t
    if torch.is_grad_enabled():
        with torch.no_grad():
            return t.to_local()
    return t.to_local()


def check_sharded_param(p: torch.Tensor) -> None:
    """Refuse a DTensor parameter whose local shard is not one contiguous row range of it."""
    if not is_sharded(p):
        return
    for placement in p.placements:
        if not (isinstance(placement, Replicate) or (type(placement) is Shard and placement.dim == 0)):
            raise ValueError(
                f"a DTensor parameter of shape {tuple(p.shape)} with placements {tuple(p.placements)} is not "
                "supported: fusedopt updates sharded parameters whose every mesh dimension is Shard(0) or "
                "Replicate() (fully_shard's default, and replicate). A shard_placement_fn sharding other "
                "dimensions, or tensor parallelism, is not supported"
            )


def element_offset(p: torch.Tensor) -> int:
    """The global row-major index of the first element of ``p``'s local shard (0 for a plain tensor)."""
    if not is_sharded(p) or p.dim() == 0:
        return 0
    check_sharded_param(p)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) * math.prod(p.shape[1:])


def check_sharded_gradient(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Refuse a DTensor gradient whose local tensor is not the gradient of ``p``'s local shard: one of
    a plain parameter, or of other placements (a ``Partial`` one holds this rank's unreduced
    contribution)."""
    if is_sharded(p) == is_sharded(grad) and (not is_sharded(p) or tuple(grad.placements) == tuple(p.placements)):
        return
    got = f"placements {tuple(grad.placements)}" if is_sharded(grad) else "a plain tensor"
    want = f"placements {tuple(p.placements)}" if is_sharded(p) else "a plain tensor"
    raise ValueError(
        f"the gradient of a parameter of shape {tuple(p.shape)} is {got}, expected {want}: the update would read "
        "an unreduced or mislaid gradient"
    )


def as_sharded(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The local tensor ``t`` (of ``p``'s local shape) as a DTensor laid out as ``p``."""
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def shard_groups(p: torch.Tensor) -> tuple:
    """The process groups whose ranks' local shards together make up ``p``: one per mesh dimension
    that shards it (``Shard(0)``) over more than one rank. Empty for a plain tensor, or where every
    rank holds all of ``p``."""
    if not is_sharded(p):
        return ()
    mesh = p.device_mesh
    return tuple(
        mesh.get_group(dim)
        for dim, placement in enumerate(p.placements)
        if isinstance(placement, Shard) and mesh.size(dim) > 1
    )


def sum_over_shards(t: torch.Tensor, groups: tuple) -> torch.Tensor:
    """Sum ``t`` in place over every rank of ``groups`` (``shard_groups``). An all-reduce enqueued
    on the current stream: no host synchronisation (NCCL); gloo on CPU blocks, as CPU work does."""
    for group in groups:
        torch.distributed.all_reduce(t, group=group)
    return t


def reset_fsdp_backward_state(model: torch.nn.Module) -> None:
    """After an exception inside backward under FSDP2 (``fully_shard``): put ``model``'s FSDP2 modules
    back in the state their end-of-backward callback leaves. A failed backward never runs that
    callback, and FSDP2 keeps it marked as queued, so it never runs again: later steps reduce and
    release gradients wrongly. Gradients the failed pass left unreduced are dropped, never reduced
    (call it on every rank, after the optimizer's ``zero_grad()``). A model without FSDP2 modules is
    left alone."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        for module in modules:
            state = module._get_fsdp_state()
            if state._is_root is None:  # never ran forward as or under a root (its layers called on their own)
                continue
            context = state._state_ctx
            context.iter_forward_root = None
            context.post_backward_final_callback_queued = False
            for other in context.all_states:
                other._modules_to_run_forward.clear()
                for group in other._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.unsharded_accumulated_grad = None
                        if fsdp_param.unsharded_param.grad is not None:
                            fsdp_param.unsharded_param.grad = None
                    if group.is_unsharded:
                        group.reshard()
                    group._training_state = TrainingState.IDLE
                other._training_state = TrainingState.IDLE
            if state._comm_ctx is not None:
                state._comm_ctx.post_forward_order.clear()
                state._comm_ctx.reduce_scatter_states.clear()
    except (AttributeError, ImportError) as error:
        raise RuntimeError(
            f"reset_fsdp_backward_state does not know this torch's FSDP2 ({torch.__version__}): {error}. Rebuild "
            "the model and optimizer and load the last checkpoint instead"
        ) from error
