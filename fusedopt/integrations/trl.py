"""TRL's trainers with a fusedopt optimizer (needs ``trl``, ``transformers`` and ``accelerate``).

``FusedOptSFTTrainer`` is ``trl.SFTTrainer`` with ``FusedOptTrainerMixin``
(``fusedopt.integrations.huggingface``), given its optimizer as
``optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True, ...))`` or ``optimizers=(optimizer, scheduler)``:
the ``SFTConfig``'s ``max_grad_norm`` clips inside the optimizer and the logged ``grad_norm`` is the
optimizer's; with ``fused=True`` its ``gradient_accumulation_steps`` becomes the optimizer's
``accumulation_steps`` and fp16's ``GradScaler`` its ``grad_scaler``; unset ``lr``, ``betas`` and ``eps``
come from the config; contradictions are refused when ``train()`` starts. TRL's other trainers take the
same mixin, first among the bases::

    class FusedOptDPOTrainer(FusedOptTrainerMixin, trl.DPOTrainer):
        pass
"""

from __future__ import annotations

import trl

from fusedopt.integrations.huggingface import FusedOptTrainerMixin

__all__ = ["FusedOptSFTTrainer", "FusedOptTrainerMixin"]


class FusedOptSFTTrainer(FusedOptTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` driving a fusedopt optimizer (see ``fusedopt.integrations.trl``)."""
