"""Handles: the only code that touches ``llamacrab_sys``. One module per native handle type.

Every pointer from C is checked here, every handle is freed exactly once (children before
parents), and every call that can throw goes through an exception-safe shim (``call``).
"""

from llamacrab._native.sys_check import check_installed

# Before any handle module binds to llamacrab_sys.lib: a mismatched llamacrab-sys fails here
# with both versions named, not later with a missing symbol or a wrong struct layout.
check_installed()
