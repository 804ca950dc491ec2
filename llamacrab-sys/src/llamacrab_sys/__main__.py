"""Print what this llamacrab_sys was built from (python -m llamacrab_sys [--json])."""

import json
import sys

from llamacrab_sys import build_info


def main() -> None:
    info = build_info().as_dict()
    if "--json" in sys.argv[1:]:
        print(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if isinstance(value, (list, tuple)):
            value = "\n    ".join([""] + [str(v) for v in value])
        elif isinstance(value, dict):
            value = "\n    ".join([""] + [f"{k}: {v}" for k, v in value.items()])
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
