"""A projector file loaded first in a child process.

libmtmd trusts a projector's tensors: it looks them up by name without checking their shapes
against the hyperparameters, then builds a graph at load time and computes it at the first
image or sound. A tensor missing, renamed or of another shape, or a width, head count or image
size that disagrees with the tensors, fails a GGML_ASSERT (an abort) or dereferences a null
tensor in either, and neither can be caught. A complete check would restate every projector
type's graph; instead, a child process (``projector_trial``) loads the file first and encodes
a small image or sound with it, and if it dies the projector is refused before this process
loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llamacrab._exceptions import ModelLoadError
from llamacrab._exit_status import describe

PROBE_SECONDS = 600  # a large projector from a slow disk, loaded in full


def probe(model: Path, projector: Path) -> None:
    """Raise ModelLoadError if loading ``projector`` for ``model`` kills a child process."""
    command = [sys.executable, "-m", "llamacrab._native.projector_trial", str(model),
               str(projector)]  # fmt: skip
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # no debugger attached to print a trace
    try:
        child = subprocess.run(command, capture_output=True, text=True, errors="replace",
                               env=env, timeout=PROBE_SECONDS, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ModelLoadError(
            f"loading the projector {projector.name} did not finish in {PROBE_SECONDS} s in a "
            "child process that tried it first"
        ) from None
    except OSError as error:  # no interpreter to start (an embedded or frozen Python)
        raise ModelLoadError(
            f"could not start a child process to try the projector {projector.name} first "
            f"({error}); pass mmproj_probe=False to load a projector you trust without it"
        ) from None
    if child.returncode in LIVED:
        return  # it worked, or refused the file with an error the load here reports again
    raise ModelLoadError(
        f"the projector {projector.name} does not fit its own description: it killed a "
        f"child process that loaded it and encoded a test input first "
        f"({describe(child.returncode)}: {_native_reason(child.stderr)})"
    )


# projector_trial's own statuses: 0, it worked; 1, it refused the file. Anything else is a
# death: a signal on POSIX (a negative status), and on Windows, which has none, abort()'s 3 or
# an NTSTATUS such as 0xC0000005 (an access violation) or 0xC0000409 (a fast-fail abort).
LIVED = (0, 1)


def _native_reason(stderr: str) -> str:
    """The assertion ggml printed before aborting, or the last line of the child's output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if "GGML_ASSERT" in line or "error" in line.lower():
            return line[-300:]
    return lines[-1][-300:] if lines else "no message"
