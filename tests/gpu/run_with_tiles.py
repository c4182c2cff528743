"""Run pytest with the update kernel's tiles per program set (a candidate before it is the default).

    python tests/gpu/run_with_tiles.py TILES [pytest arguments ...]

``fusedopt.kernels.update.TILES`` is read when a parameter's launch is prepared, so setting it
before the tests build their optimizers runs every update of the session with that many tiles.
"""

import sys

import pytest

from fusedopt.kernels import update

if __name__ == "__main__":
    update.TILES = int(sys.argv[1])
    print(f"update.TILES = {update.TILES}", flush=True)
    sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[2:]]))
