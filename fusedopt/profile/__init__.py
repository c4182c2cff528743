"""``fusedopt.profile``: what a training step costs in memory, per optimizer configuration.

Command line (``python -m fusedopt.profile`` or ``fusedopt-profile``)::

    fusedopt-profile                                  # embedded LM; torch.optim.AdamW vs fusedopt defaults
    fusedopt-profile --model 1b --batch 1 --seq-len 1024 --dtype bf16
    fusedopt-profile --shape layers=4,d_model=256,heads=4 --config torch --config fusedopt:fused=True
    fusedopt-profile --hf-config path/to/config.json  # a transformers model, built from its config
    fusedopt-profile plan --params 7e9 --gpu-memory 24 --dtype bf16
    fusedopt-profile plan --model 1b --gpu-memory 16 --results out/fusedopt-profile/results.json

Each configuration runs real training steps (forward, backward, update) of the same model in
a fresh process, so figures cannot leak from one configuration into the next. One step is
tracked: its peak, the memory that persists between steps, the breakdown of the peak into
parameters, master-weight corrections, optimizer state, gradients, activations and the rest,
and which phase (forward, backward, update) holds the peak. The output says which method
produced each figure (see ``memory.py``). A table goes to the terminal, a
memory-over-time plot to a PNG when matplotlib is installed, and everything to JSON.

Python API: :func:`run_profile` (what the command runs), :class:`MemoryTracker` (track any
step in-process), :func:`profile_step` (one tracked step of your own model and optimizer),
:func:`plan` (which configurations fit).

Modules, each importing only those above it: ``models`` (model specs, the embedded LM),
``competitors`` (other libraries' optimizers), ``configs`` (``--config`` strings), ``memory``
(the tracker), ``planner`` (what fits), ``report`` (table, plot), ``run`` (the measurement),
``cli`` (the command line).
"""

from fusedopt.profile.cli import main
from fusedopt.profile.configs import DEFAULT_CONFIGS, OPTIMIZERS, OptimizerConfig, parse_config
from fusedopt.profile.memory import MemoryTracker, StepMemory
from fusedopt.profile.models import ModelSpec, UserError
from fusedopt.profile.planner import PlanRow, Recommendation, plan, recommend
from fusedopt.profile.run import ProfileReport, profile_step, run_profile

__all__ = [
    "MemoryTracker",
    "StepMemory",
    "OptimizerConfig",
    "OPTIMIZERS",
    "ModelSpec",
    "ProfileReport",
    "PlanRow",
    "UserError",
    "DEFAULT_CONFIGS",
    "parse_config",
    "profile_step",
    "run_profile",
    "plan",
    "recommend",
    "Recommendation",
    "main",
]
