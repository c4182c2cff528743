"""``fused=True`` on a ``torch.compile``d model with the inductor backend on the GPU: bit-identical
to compiled ``fused=False`` (bf16 MLP, 8-bit state, bf16 weights + correction, the Triton update
kernel, bucketed updates). Run on the H200: ``pytest -m gpu tests/gpu/test_compile_cuda.py``."""

import pytest
import torch
from test_compile import assert_same_training, train_compiled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_long,  # the long tier (tests/gpu/README.md): inductor compiles a model four times
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("bucket_mb", ["128", "0"], ids=["bucketed", "one-launch-each"])
def test_release_on_an_inductor_compiled_model_is_bit_identical_to_compiled_fused_false(monkeypatch, bucket_mb):
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", bucket_mb)
    torch._dynamo.reset()
    unfused = train_compiled(False, "inductor", device="cuda", width=1024, steps=5)
    assert_same_training(train_compiled(True, "inductor", device="cuda", width=1024, steps=5), unfused)
