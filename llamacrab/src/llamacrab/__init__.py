"""llamacrab: run large language models locally on top of llama.cpp.

The safe high-level API is being built on top of ``llamacrab_sys`` (see the repository README for
what has landed). Until then this package only reports what native build it runs on.
"""

from llamacrab_sys import BuildInfo, build_info

__version__ = "0.1.0"

__all__ = ["BuildInfo", "__version__", "build_info"]
