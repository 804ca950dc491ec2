"""The models in a folder, as a multi-model server lists them: each GGUF one model named by its
file (split parts as one), ``mmproj-NAME.gguf`` as NAME's projector, embedding and reranker
models recognised from their header; a subfolder with one model in it is that model.

Links are followed, as llama-server's scan follows them: a model file linked to its blob (the
Hugging Face cache's layout) or a subfolder linked to a snapshot elsewhere is the folder owner's
choice. A linked subfolder that leads back to the folder or above it (``up -> ..``) is skipped:
it would serve the files around the folder (an adapter, another project's models)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.gguf_memory import read_metadata

log = logging.getLogger("llamacrab")
_PART = re.compile(r"^(.*)-(\d{5})-of-(\d{5})$")
_RANK_POOLING = 4  # LLAMA_POOLING_TYPE_RANK


@dataclass(frozen=True)
class FoundModel:
    """A model found in a folder: its name, file (the first part of a split model) and the
    ``Llama`` options it needs (a projector, an embeddings or reranking context)."""

    name: str
    path: Path
    options: dict[str, Any] = field(default_factory=dict)


def _is_projector(path: Path, metadata: dict[str, Any] | None) -> bool:
    name = path.name.lower()
    return name.startswith("mmproj") or (
        metadata is not None and metadata.get("general.architecture") == "clip"
    )


def _kind_options(metadata: dict[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}  # unreadable: loading it will say why
    arch = metadata.get("general.architecture", "")
    pooling = metadata.get(f"{arch}.pooling_type")
    if pooling == _RANK_POOLING:
        return {"embeddings": True, "pooling": "rank"}
    if metadata.get(f"{arch}.attention.causal") is False or pooling in (1, 2, 3):
        return {"embeddings": True}
    return {}


def _metadata(path: Path) -> dict[str, Any] | None:
    try:
        return read_metadata(path)
    except Exception:  # a broken file is listed; it fails (with its reason) when loaded
        return None


def _model_name(stem: str) -> str | None:
    """The name of a model file's stem; None for a split part other than the first."""
    match = _PART.match(stem)
    if match is None:
        return stem
    return match.group(1) if int(match.group(2)) == 1 else None


def _pair(projector: Path, models: dict[str, FoundModel]) -> str | None:
    """The model a projector belongs to: ``mmproj-NAME`` names it, or shares its longest
    prefix; the only model when there is one."""
    rest = re.sub(r"^mmproj[-_.]?", "", projector.stem, flags=re.IGNORECASE).lower()
    if rest in (n.lower() for n in models):
        return next(n for n in models if n.lower() == rest)

    def shared(name: str) -> int:
        return len(_common_prefix(name.lower(), rest))

    best = max(models, key=shared, default=None)
    if best is not None and rest and shared(best) >= max(4, len(rest) // 2):
        return best
    return next(iter(models)) if len(models) == 1 else None


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _scan_files(files: list[Path]) -> tuple[dict[str, FoundModel], list[Path]]:
    models: dict[str, FoundModel] = {}
    projectors = []
    for path in sorted(files):
        metadata = _metadata(path)
        if _is_projector(path, metadata):
            projectors.append(path)
            continue
        if metadata is not None and metadata.get("general.type") == "adapter":
            continue  # a LoRA or a control vector: applied to a model, never served alone
        name = _model_name(path.stem)
        if name is not None:
            models[name] = FoundModel(name, path, _kind_options(metadata))
    return models, projectors


def _gguf_files(folder: Path) -> list[Path]:
    """The regular files named ``*.gguf`` in ``folder``: a FIFO, a device or a folder of that
    name is no model (and would make a subfolder look like several)."""
    return [path for path in folder.glob("*.gguf") if path.is_file() and _utf8_name(path)]


def _utf8_name(path: Path) -> bool:
    """Whether ``path``'s name is text: one that is not UTF-8 cannot be a model's name in
    JSON (every listing answered 500, /health too); it is skipped, with a warning."""
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:
        log.warning("skipping %r: its name is not UTF-8", path)
        return False
    return True


def _loops_back(sub: Path, folder: Path) -> bool:
    """Whether ``sub`` is a link to ``folder`` or a folder above it (warned about)."""
    if not sub.is_symlink():
        return False
    target, root = sub.resolve(), folder.resolve()
    if target != root and target not in root.parents:
        return False
    log.warning("skipping %s: it links back to %s, not to a model's folder", sub, target)
    return True


def _subfolders(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if p.is_dir() and _utf8_name(p) and not _loops_back(p, folder)
    )


def scan_models_dir(folder: Path) -> list[FoundModel]:
    """Every model in ``folder`` (and its subfolders of one model each), sorted by name."""
    if not folder.is_dir():
        raise InvalidParameterError(f"models folder {folder} is not a directory")
    models, projectors = _scan_files(_gguf_files(folder))
    for sub in _subfolders(folder):
        inner, inner_projectors = _scan_files(_gguf_files(sub))
        if len(inner) == 1:
            found = next(iter(inner.values()))
            inner = {sub.name: FoundModel(sub.name, found.path, found.options)}
        for name, found in inner.items():
            for projector in inner_projectors[:1] if len(inner) == 1 else []:
                found.options["mmproj"] = str(projector)
            models.setdefault(name, found)
    for projector in projectors:
        owner = _pair(projector, {n: m for n, m in models.items() if not m.options})
        if owner is None:
            log.warning("no model in %s for the projector %s", folder, projector.name)
        else:
            models[owner].options["mmproj"] = str(projector)
    return [models[name] for name in sorted(models)]
