"""``python -m llamacrab.server MODEL [flags]``: the same as ``llamacrab serve``."""

import sys

from llamacrab.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
