"""``python -m llamacrab``: the command line (see llamacrab.cli)."""

import sys

from llamacrab.cli import main

sys.exit(main())
