"""``python -m llamacrab.server MODEL [flags]``: the same as ``llamacrab serve``."""

from llamacrab.server import parse_settings, serve

serve(parse_settings())
