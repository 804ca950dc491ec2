"""Which llamacrab_sys this llamacrab supports: its version series and llama.cpp commits.

llamacrab_sys is installed separately (one wheel per backend, from its own index), so pip alone
cannot guarantee a matching pair: this check runs when ``llamacrab._native`` is first imported,
before any handle calls C through bindings generated from other headers.
"""

from __future__ import annotations

import logging
import os
import re

from llamacrab._exceptions import SysVersionError

# Keep in step with the requirement in llamacrab/pyproject.toml (llamacrab-sys>=0.1,<0.2);
# tests/test_sys_check.py compares them.
SYS_SERIES = (0, 1)
# The llama.cpp commits this llamacrab was tested against; the bump workflow adds each new pin
# (tests/test_sys_check.py checks that llamacrab-sys/pin.json is listed).
SUPPORTED_LLAMA_CPP_COMMITS = frozenset({"0c1e57098bba43ac29e6e3b677cdceebdd22334f"})
# With this set, any llama.cpp commit runs at the user's risk: the commit check warns instead.
ALLOW_ANY_COMMIT_ENV = "LLAMACRAB_ALLOW_ANY_LLAMA_CPP"

_RELEASE = re.compile(r"(\d+)\.(\d+)")
_logger = logging.getLogger("llamacrab")


def _series_text() -> str:
    return ".".join(map(str, SYS_SERIES)) + ".x"


def check_sys(version: str, commit: str, own_llama_cpp: bool = False) -> None:
    """Raise SysVersionError unless llamacrab_sys ``version`` built from ``commit`` is supported.

    ``own_llama_cpp``: llamacrab-sys was built against the user's own llama.cpp install, whose
    API the build already checked against what llamacrab calls; another commit only warns.
    """
    match = _RELEASE.match(version)
    if match is None or (int(match[1]), int(match[2])) != SYS_SERIES:
        raise SysVersionError(
            f"llamacrab needs llamacrab-sys {_series_text()}, but llamacrab-sys {version} is "
            f"installed: install llamacrab-sys>={SYS_SERIES[0]}.{SYS_SERIES[1]},"
            f"<{SYS_SERIES[0]}.{SYS_SERIES[1] + 1} from your backend's index, or a llamacrab "
            "release made for this llamacrab-sys"
        )
    if commit.lower() in SUPPORTED_LLAMA_CPP_COMMITS:
        return
    supported = ", ".join(sorted(c[:12] for c in SUPPORTED_LLAMA_CPP_COMMITS))
    message = (
        f"llamacrab-sys {version} was built from llama.cpp {commit[:12] or '(unknown)'}, but "
        f"llamacrab supports llama.cpp {supported}"
    )
    if own_llama_cpp:
        _logger.warning("%s; continuing with your own llama.cpp build", message)
        return
    if os.environ.get(ALLOW_ANY_COMMIT_ENV) == "1":
        _logger.warning("%s; continuing because %s=1", message, ALLOW_ANY_COMMIT_ENV)
        return
    raise SysVersionError(
        f"{message}: install a llamacrab-sys {_series_text()} built from a supported commit "
        f"(or set {ALLOW_ANY_COMMIT_ENV}=1 to run at your own risk)"
    )


def check_installed() -> None:
    """Check the llamacrab_sys this process imports."""
    import llamacrab_sys

    info = llamacrab_sys.build_info()
    own = info.llama_cpp_prefix is not None
    check_sys(llamacrab_sys.__version__, info.llama_cpp_commit, own_llama_cpp=own)
