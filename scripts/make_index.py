"""Build per-backend PEP 503 "simple" package indexes from wheels.

    python scripts/make_index.py SITE WHEEL_OR_DIR [WHEEL_OR_DIR ...]

Each ``llamacrab_sys`` wheel goes to the index of the backend it was built for: ``cpu/``,
``cu12x/``, ``cu13x/`` or ``vulkan/``. The backend is read from the wheel itself (the
``llamacrab_sys/_build_info.json`` every build records), not from its file name: the variants
share one version and one file name, so they arrive in separate directories and only their
contents tell them apart. Pure Python wheels (``llamacrab``) go to ``normal/``, the stand-in
for PyPI. Wheels already in SITE stay: the pages are rebuilt from everything there, so a
release adds its wheels to the published site and earlier versions remain installable.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import html
import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

NORMAL_INDEX = "normal"
SYS_PROJECT = "llamacrab-sys"
# Apple silicon's only llamacrab-sys wheel is its platform default (Metal), so it sits in the
# default index beside the Linux and Windows CPU wheels; the platform tags keep them apart.
_PLAIN_BACKENDS = {"cpu": "cpu", "metal": "cpu", "vulkan": "vulkan"}
_NVCC_RELEASE = re.compile(r"release (\d+)\.")


class WheelPlacementError(Exception):
    """A wheel that cannot be placed in an index."""


def normalize(name: str) -> str:
    """The PEP 503 normalized form of a project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _read_member(archive: zipfile.ZipFile, suffix: str) -> str | None:
    for member in archive.namelist():
        if member == suffix or member.endswith("/" + suffix):
            return archive.read(member).decode("utf-8")
    return None


def wheel_metadata(wheel: Path) -> dict[str, str]:
    """Name, version and Requires-Python from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        text = next(
            (
                archive.read(m).decode("utf-8")
                for m in archive.namelist()
                if m.count("/") == 1 and m.endswith(".dist-info/METADATA")
            ),
            None,
        )
    if text is None:
        raise WheelPlacementError(f"{wheel.name}: no .dist-info/METADATA inside; not a wheel")
    message = email.parser.Parser().parsestr(text, headersonly=True)
    return {
        "name": message.get("Name", ""),
        "version": message.get("Version", ""),
        "requires_python": message.get("Requires-Python", "") or "",
    }


def backend_index(wheel: Path) -> str:
    """The index a llamacrab_sys wheel belongs to, from the build info it carries."""
    with zipfile.ZipFile(wheel) as archive:
        text = _read_member(archive, "llamacrab_sys/_build_info.json")
    if text is None:
        raise WheelPlacementError(
            f"{wheel.name}: no llamacrab_sys/_build_info.json; backend unknown"
        )
    info = json.loads(text)
    backend = info.get("backend", "")
    if backend in _PLAIN_BACKENDS:
        return _PLAIN_BACKENDS[backend]
    if backend == "cuda":
        # The CUDA major version decides which runtime libraries the wheel needs (cu12x, cu13x).
        found = _NVCC_RELEASE.search(info.get("compilers", {}).get("nvcc", ""))
        major = info.get("cuda_version", "").split(".")[0] or (found.group(1) if found else "")
        if not major:
            raise WheelPlacementError(
                f"{wheel.name}: a CUDA build that does not record its CUDA version"
            )
        return f"cu{major}x"
    raise WheelPlacementError(f"{wheel.name}: no index for backend {backend!r}")


def index_for(wheel: Path) -> tuple[str, str, dict[str, str]]:
    """(index directory, normalized project, metadata) for one wheel."""
    meta = wheel_metadata(wheel)
    project = normalize(meta["name"])
    if not project:
        raise WheelPlacementError(f"{wheel.name}: METADATA has no Name")
    if project == SYS_PROJECT:
        return backend_index(wheel), project, meta
    if not wheel.name.endswith("-none-any.whl"):
        raise WheelPlacementError(f"{wheel.name}: only llamacrab-sys may be platform-specific")
    return NORMAL_INDEX, project, meta


def sha256(path: Path) -> str:
    # Wheels are tens of megabytes at most: reading one whole is fine.
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _page(title: str, links: list[str]) -> str:
    body = "\n".join(f"    {link}<br>" for link in links)
    return (
        '<!DOCTYPE html>\n<html>\n  <head>\n    <meta name="pypi:repository-version" '
        f'content="1.0">\n    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n'
        f"{body}\n  </body>\n</html>\n"
    )


def add_wheel(site: Path, wheel: Path) -> Path:
    """Copy one wheel into its index under SITE; return where it landed."""
    index, project, _ = index_for(wheel)
    target = site / index / project / wheel.name
    if target.exists():
        if sha256(target) != sha256(wheel):
            raise WheelPlacementError(
                f"{index}/{project}/{wheel.name} exists with different contents"
            )
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel, target)
    return target


def write_pages(site: Path) -> list[Path]:
    """(Re)write every index.html from the wheels present under SITE; return the index roots."""
    roots = sorted(p for p in site.iterdir() if p.is_dir() and any(p.glob("*/*.whl")))
    for root in roots:
        projects = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.whl")))
        for project in projects:
            links = []
            for wheel in sorted(project.glob("*.whl")):
                requires = wheel_metadata(wheel)["requires_python"]
                attr = f' data-requires-python="{html.escape(requires)}"' if requires else ""
                href = f"{wheel.name}#sha256={sha256(wheel)}"
                links.append(f'<a href="{html.escape(href)}"{attr}>{html.escape(wheel.name)}</a>')
            (project / "index.html").write_text(_page(f"Links for {project.name}", links))
        links = [f'<a href="{p.name}/">{p.name}</a>' for p in projects]
        (root / "index.html").write_text(_page("Simple index", links))
    return roots


def collect(paths: list[Path]) -> list[Path]:
    wheels: list[Path] = []
    for path in paths:
        if path.is_dir():
            wheels += sorted(path.rglob("*.whl"))
        elif path.suffix == ".whl" and path.is_file():
            wheels.append(path)
        else:
            raise WheelPlacementError(f"{path}: neither a wheel nor a directory")
    return wheels


def build(site: Path, inputs: list[Path]) -> dict[str, list[str]]:
    """Add the wheels to SITE and rewrite its pages; return {index: [wheel names]}."""
    site.mkdir(parents=True, exist_ok=True)
    placed: dict[str, list[str]] = {}
    for wheel in collect(inputs):
        target = add_wheel(site, wheel)
        placed.setdefault(target.parent.parent.name, []).append(wheel.name)
    write_pages(site)
    return placed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="output directory (existing wheels are kept)")
    parser.add_argument("inputs", type=Path, nargs="+", help="wheels, or directories of wheels")
    args = parser.parse_args(argv)
    try:
        placed = build(args.site, args.inputs)
    except (WheelPlacementError, zipfile.BadZipFile, OSError, json.JSONDecodeError) as exc:
        print(f"make_index: {exc}", file=sys.stderr)
        return 1
    for index, names in sorted(placed.items()):
        print(f"{index}/: " + ", ".join(sorted(names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
