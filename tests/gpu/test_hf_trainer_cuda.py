"""FusedOptTrainer on the GPU (run on the H200: ``pytest -m gpu tests/gpu/test_hf_trainer_cuda.py``):
fp16 mixed precision (accelerate's GradScaler, handed to the releasing optimizer) with clipping
configured, on the Triton update kernel, trains as ``fused=False`` under the same scaler."""

import pytest
import torch
from test_hf_trainer import TokenDataset, params, step_logs, tiny_llama, training_args

import fusedopt
from fusedopt.integrations.huggingface import FusedOptTrainer, fused_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_long,  # the long tier (tests/gpu/README.md): two Trainer runs
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fp16_trainer_with_release_equals_fused_false_on_cuda(tmp_path):
    results = []
    for fused in (True, False):
        model = tiny_llama()  # fp32 weights, fp16 autocast
        trainer = FusedOptTrainer(
            model=model,
            args=training_args(tmp_path / str(fused), use_cpu=False, fp16=True, max_grad_norm=1e4),
            train_dataset=TokenDataset(),
            optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=fused, min_compress_numel=0)),
        )
        trainer.train()
        opt, scaler = fused_optimizer(trainer.optimizer), trainer.accelerator.scaler
        assert scaler is not None and opt.grad_scaler is (scaler if fused else None)
        assert scaler.state_dict()["_growth_tracker"] == 6 and int(opt.num_skipped_updates) == 0  # no overflow
        assert all(p.is_cuda for p in model.parameters())
        results.append((params(model), step_logs(trainer, "loss"), step_logs(trainer, "grad_norm")))
    (fused_params, fused_losses, fused_norms), (plain_params, plain_losses, plain_norms) = results
    assert fused_losses == plain_losses
    torch.testing.assert_close(fused_norms, plain_norms, rtol=1e-5, atol=0)
    for name in fused_params:
        assert torch.equal(fused_params[name], plain_params[name]), name
