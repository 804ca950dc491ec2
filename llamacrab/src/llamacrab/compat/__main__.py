"""python -m llamacrab.compat [--force] SCRIPT.py [ARGS...]: run a script written for
llama-cpp-python on llamacrab (``import llama_cpp`` gives llamacrab.compat), unchanged."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from llamacrab.compat._shim import install


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llamacrab.compat", description=__doc__)
    parser.add_argument(
        "--force", action="store_true", help="shadow a real llama-cpp-python if one is installed"
    )
    parser.add_argument("script", help="the Python file to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    options = parser.parse_args(argv)
    install(force=options.force)
    sys.argv = [options.script, *options.args]
    sys.path[0] = os.path.dirname(os.path.abspath(options.script))  # as `python SCRIPT` has it
    runpy.run_path(options.script, run_name="__main__")


if __name__ == "__main__":
    main()
