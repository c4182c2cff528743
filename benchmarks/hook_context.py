"""Is host work slower inside a backward hook than outside it, and which kind? (CUDA only.)

    python benchmarks/hook_context.py [--preset 1b] [--reps 200]

The release benchmark (benchmarks/release_overhead.py) finds an update's host time 1.5-3x
higher inside backward than in ``step()``, even when the same Python runs in one burst. This
times three kinds of host work, each ``--reps`` times, once in a post-accumulate-grad hook of the
1.1B model's backward (activation checkpointing, as the release benchmark) and once after it:

  python   a pure-Python loop (dict and attribute work, no torch calls)
  tensor   torch tensor attribute calls (data_ptr, is_contiguous, numel: what the update path does)
  launch   one prepared fusedopt kernel launch pair on a small parameter (direct launch)

It also reports the hook's thread, whether a torch function mode is active there, and
``sys.getprofile()``, which would each slow Python down.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

import fusedopt
from fusedopt.profile.models import PRESETS, TinyLM, random_batch


def _python_work(n: int) -> None:
    d = {}
    for i in range(n):
        d[i & 63] = d.get(i & 63, 0) + 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test the script")
    args = parser.parse_args(argv)
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = TinyLM(PRESETS[args.preset], checkpointing=True, device=device, dtype=torch.bfloat16)
    small = torch.nn.Parameter(torch.randn(64, 64, device=device, dtype=torch.bfloat16))
    opt = fusedopt.AdamW([small], lr=1e-4, min_compress_numel=0)
    small.grad = torch.randn_like(small)
    opt.step()
    opt.step()  # the prepared launch exists from here
    prepared = opt._dispatch._prepared[small].launch
    grad = small.grad
    scalars = opt._dispatch.settings(0).scalars
    tensors = [p for p in model.parameters()][:16]

    def work() -> dict:
        out = {}
        t0 = time.perf_counter()
        for _ in range(args.reps):
            _python_work(100)
        out["python"] = (time.perf_counter() - t0) / args.reps * 1e6
        t0 = time.perf_counter()
        for _ in range(args.reps):
            for t in tensors:
                t.data_ptr(), t.is_contiguous(), t.numel()
        out["tensor"] = (time.perf_counter() - t0) / args.reps * 1e6
        t0 = time.perf_counter()
        for _ in range(args.reps):
            prepared.launch(grad, None, scalars)
        out["launch"] = (time.perf_counter() - t0) / args.reps * 1e6
        return out

    seen = {}

    def hook(_):
        if "inside" not in seen:
            seen["thread"] = threading.current_thread().name
            seen["function_mode"] = torch._C._is_torch_function_mode_enabled()
            seen["profile"] = sys.getprofile()
            seen["grad_enabled"] = torch.is_grad_enabled()
            seen["inside"] = work()

    params = list(model.parameters())
    params[len(params) // 2].register_post_accumulate_grad_hook(hook)  # a middle layer's: mid-backward
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(2):  # warm-up, then the measured backward
        seen.clear()
        ids, labels = random_batch(PRESETS[args.preset].vocab, 1, 1024, device, gen)
        model(ids, labels=labels).backward()
        sync()
    outside = work()
    sync()
    print(f"hook thread: {seen['thread']}; torch function mode active: {seen['function_mode']}; "
          f"sys.getprofile(): {seen['profile']}; grad enabled: {seen['grad_enabled']}")  # fmt: skip
    print("| work (us per repetition) | inside a backward hook | after backward | ratio |\n|---|---|---|---|")
    for key, value in seen["inside"].items():
        print(f"| {key} | {value:.1f} | {outside[key]:.1f} | {value / outside[key]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
