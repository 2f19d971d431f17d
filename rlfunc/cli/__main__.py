"""``python -m rlfunc.cli ...``, the same as ``rlfunc ...``."""

import sys

from rlfunc.cli.commands import main

sys.exit(main())
