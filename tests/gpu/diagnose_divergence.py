"""Where do the GPU kernel and the CPU reference part ways? (diagnostic, run on a GPU machine)

  python tests/gpu/diagnose_divergence.py

For a few configurations: each step, the CPU reference and the GPU kernel start from the
SAME state (the CPU's, copied) and get the same gradient; prints the fraction of elements
whose result differs (parameter, correction, codes, scales) and the kernel's bias-correction
words against the reference's. A config that matches every step but drifts when run free
points at accumulated rounding; one that differs from the first step at a bug.
"""

import torch

import fusedopt


def run(opt_cls, dtype, kwargs, steps=12, shape=(257, 1031)):
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(*shape, generator=gen).to(dtype)
    grads = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(steps)]
    wc = torch.nn.Parameter(w0.clone())
    wg = torch.nn.Parameter(w0.cuda())
    oc = opt_cls([wc], lr=1e-3, min_compress_numel=0, **kwargs)
    og = opt_cls([wg], lr=1e-3, min_compress_numel=0, **kwargs)
    print(f"== {opt_cls.__name__} {dtype} {kwargs}")
    for i, g in enumerate(grads):
        if i > 0:  # same start: copy the CPU's parameter and state to the GPU
            with torch.no_grad():
                wg.copy_(wc.detach().cuda())
            for k, v in oc.state[wc].items():
                og.state[wg][k].copy_(v.to("cuda"))
        wc.grad, wg.grad = g.clone(), g.cuda()
        oc.step()
        og.step()
        torch.cuda.synchronize()
        diffs = {"param": (wc.detach() != wg.detach().cpu()).double().mean().item()}
        for k, v in oc.state[wc].items():
            diffs[k] = (v != og.state[wg][k].cpu()).double().mean().item()
        scratch = next(iter(og._dispatch._scratch.values())).cpu()
        words = scratch[3:5].view(torch.float32).tolist()
        step = oc.state[wc]["step"].double()
        beta1, beta2 = 0.9, 0.999
        ref = [float((torch.tensor(1e-3, dtype=torch.float32).double() / (1 - beta1**step)).float())]
        ref.append(float((1 / (1 - beta2**step).sqrt()).float()))
        print(f"step {i + 1}: " + " ".join(f"{k}={v:.2e}" for k, v in diffs.items()), "bias words", words, "ref", ref)


if __name__ == "__main__":
    run(fusedopt.AdamW, torch.float32, dict(state_bits=32))
    run(fusedopt.AdamW, torch.bfloat16, dict(state_bits=16, master_weight_bits=None))
    run(fusedopt.AdamW, torch.bfloat16, dict(state_bits=8, master_weight_bits=24))
    run(fusedopt.AdamW, torch.bfloat16, dict(state_bits=32, master_weight_bits=32))
