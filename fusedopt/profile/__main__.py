"""``python -m fusedopt.profile``: the ``fusedopt-profile`` command."""

import sys

from fusedopt.profile.cli import main

sys.exit(main())
