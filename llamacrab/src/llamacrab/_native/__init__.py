"""Handles: the only code that touches ``llamacrab_sys``. One module per native handle type.

Every pointer from C is checked here, every handle is freed exactly once (children before
parents), and every call that can throw goes through a ``noexcept`` shim (``call``).
"""
