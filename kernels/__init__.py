"""Triton kernels of fusedopt, installed as ``fusedopt.kernels`` (internal, unstable API).

The repo keeps them in a top-level ``kernels/`` directory; packaging maps it to
``fusedopt.kernels``. Import them only by that name and, inside this package, with
sibling-relative imports. Every kernel has a plain-PyTorch reference in ``fusedopt`` that
it is tested against (under ``TRITON_INTERPRET=1`` on the CPU, and on a GPU).
"""
