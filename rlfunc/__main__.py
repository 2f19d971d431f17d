"""``python -m rlfunc ...`` (and ``torchrun ... -m rlfunc train ALGO ...``), the same as ``rlfunc ...``."""

import sys

from rlfunc.cli.commands import main

sys.exit(main())
