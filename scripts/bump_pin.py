"""Move the llama.cpp pin to another commit (the weekly bump workflow, or by hand).

    python scripts/bump_pin.py pin COMMIT        rewrite llamacrab-sys/pin.json for COMMIT (its
                                                 GitHub archive, fetched and hashed) and add
                                                 COMMIT to the commits llamacrab supports
    python scripts/bump_pin.py asserts OLD NEW   the assert table's candidate lines (see
                                                 docs/native-aborts.md) that differ between two
                                                 llama.cpp trees, as a unified diff

Declarations and shims need no step here: the build generates them from the headers of the
tree it builds, so building the new pin regenerates them.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIN_FILE = ROOT / "llamacrab-sys" / "pin.json"
SYS_CHECK = ROOT / "llamacrab" / "src" / "llamacrab" / "_native" / "sys_check.py"
ARCHIVE_URL = "https://github.com/ggml-org/llama.cpp/archive/{commit}.tar.gz"
# docs/native-aborts.md: the files whose GGML_ASSERT / GGML_ABORT a GGUF file can reach.
ASSERT_FILES = [
    "src/llama-model.cpp", "src/llama-vocab.cpp", "src/llama-model-loader.cpp",
    "ggml/src/gguf.cpp", "src/llama-hparams.cpp", "src/llama-arch.cpp", "src/llama-graph.cpp",
    "src/llama-context.cpp", "src/llama.cpp",
]  # fmt: skip
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SUPPORTED = re.compile(r"SUPPORTED_LLAMA_CPP_COMMITS = frozenset\(\{([^}]*)\}\)")


def new_pin(commit: str, sha256: str) -> dict[str, object]:
    return {
        "llama_cpp_commit": commit,
        "source_archive": {
            "url": ARCHIVE_URL.format(commit=commit),
            "filename": f"llama.cpp-{commit}.tar.gz",
            "sha256": sha256,
            "tree": f"llama.cpp-{commit}",
        },
    }


def add_supported(text: str, commit: str) -> str:
    """sys_check.py's source with ``commit`` added to SUPPORTED_LLAMA_CPP_COMMITS."""
    match = _SUPPORTED.search(text)
    if match is None:
        raise SystemExit(f"{SYS_CHECK}: SUPPORTED_LLAMA_CPP_COMMITS not found")
    commits = set(re.findall(r'"([0-9a-f]{40})"', match[1])) | {commit}
    listed = ", ".join(f'"{c}"' for c in sorted(commits))
    return text[: match.start(1)] + listed + text[match.end(1) :]


def pin(commit: str) -> None:
    if not _COMMIT.fullmatch(commit):
        raise SystemExit(f"{commit!r} is not a full 40-digit commit hash")
    with urllib.request.urlopen(ARCHIVE_URL.format(commit=commit), timeout=300) as response:
        digest = hashlib.sha256(response.read()).hexdigest()
    PIN_FILE.write_text(json.dumps(new_pin(commit, digest), indent=2) + "\n")
    SYS_CHECK.write_text(add_supported(SYS_CHECK.read_text(), commit))
    print(f"pinned llama.cpp {commit} (archive sha256 {digest})")


def assert_lines(tree: Path) -> list[str]:
    files = ASSERT_FILES + sorted(str(p.relative_to(tree)) for p in tree.glob("src/models/*.cpp"))
    out = subprocess.run(
        ["grep", "-n", r"GGML_ASSERT\|GGML_ABORT", *files],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode > 1:  # 1 only means no match
        raise SystemExit(f"grep failed in {tree}: {out.stderr}")
    return out.stdout.splitlines(keepends=True)


def asserts(old: Path, new: Path) -> str:
    return "".join(difflib.unified_diff(assert_lines(old), assert_lines(new), str(old), str(new)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pin").add_argument("commit")
    diff = commands.add_parser("asserts")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "pin":
        pin(args.commit)
    else:
        sys.stdout.write(asserts(args.old, args.new))


if __name__ == "__main__":
    main()
