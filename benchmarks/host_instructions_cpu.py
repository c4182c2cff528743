"""Host instructions of step() per parameter update, counted by valgrind (repeatable on a noisy
machine, where wall-clock host timings vary 2x between identical runs). The two kernel launches
are stubbed as in host_overhead_cpu.py; 200 bf16 parameters of 64 x 64, default configuration.

    for n in 0 20; do valgrind --tool=callgrind --callgrind-out-file=/tmp/cg_$n.out \\
        python benchmarks/host_instructions_cpu.py --bucket-mb 128 --steps $n 2>&1 | grep Collected; done

(instructions with 20 steps - instructions with 0) / (20 x 200) = instructions per update.
"""

from __future__ import annotations

import argparse
import os
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--bucket-mb", default="128", help="FUSEDOPT_BUCKET_MB (0: one launch pair per parameter)")
parser.add_argument("--steps", type=int, default=20, help="steps after the two that build launches and buckets")
args = parser.parse_args()
os.environ["FUSEDOPT_BACKEND"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"
os.environ["FUSEDOPT_BUCKET_MB"] = args.bucket_mb
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from host_overhead_cpu import _NoLaunch  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.kernels import update  # noqa: E402

update._launch_check = update._launch_update = _NoLaunch()
params = [torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)) for _ in range(200)]
opt = fusedopt.AdamW(params, lr=1e-4, min_compress_numel=0)
for p in params:
    p.grad = torch.randn_like(p)
opt.step()  # builds the prepared launches
opt.step()  # builds the buckets
for _ in range(args.steps):
    opt.step()
