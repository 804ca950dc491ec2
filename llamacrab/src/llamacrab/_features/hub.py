"""Resolve ``org/repo`` model names to local GGUF files through the Hugging Face Hub.

Downloads go through ``huggingface_hub`` into its standard cache (shared with other tools), so
revision, token, cache directory, endpoint and offline mode behave as they do there, including
the HF_TOKEN, HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE environment variables.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from llamacrab._exceptions import HubError
from llamacrab._features.hub_guard import guarded_downloads, list_files
from llamacrab._field_types import file_path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, kw_only=True)
class HubOptions:
    """Where and how to fetch a model. ``None`` defers to huggingface_hub's own defaults and
    environment. The token never appears in repr, logs or error messages."""

    filename: str | None = None  # exact path in the repository, or a glob such as "*Q4_K_M*"
    revision: str | None = None  # branch, tag or commit
    token: str | bool | None = field(default=None, repr=False)
    cache_dir: str | os.PathLike[str] | None = None
    endpoint: str | None = None
    offline: bool | None = None  # None: HF_HUB_OFFLINE decides
    mmproj: bool | str = False  # True: the repository's one mmproj file; a str: a glob for it


@dataclass(frozen=True)
class ResolvedModel:
    """Local files of a model: the path to load, every split part, and the projector if asked."""

    path: Path
    parts: tuple[Path, ...]
    mmproj: Path | None = None
    repo_id: str | None = None
    revision: str | None = None


def looks_like_repo_id(spec: str | os.PathLike[str]) -> bool:
    """``org/repo`` that is not an existing local path."""
    text = os.fspath(spec)
    return bool(_REPO_ID.match(text)) and not Path(text).exists() and not text.endswith(".gguf")


def resolve(spec: str | os.PathLike[str], options: HubOptions | None = None) -> ResolvedModel:
    """A local path stays as it is; ``org/repo`` is looked up and downloaded (or found in the
    cache when offline)."""
    path = file_path("the model", spec)  # a repository id is text too
    if not looks_like_repo_id(spec):
        return ResolvedModel(path, (path,))
    return _Resolver(os.fspath(spec), options or HubOptions()).run()


class _Resolver:
    def __init__(self, repo_id: str, options: HubOptions) -> None:
        self.repo_id = repo_id
        self.options = options
        self.offline = options.offline
        if self.offline is None:
            self.offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")

    def run(self) -> ResolvedModel:
        files = self._list_files()
        parts = _model_files(self.repo_id, files, self.options.filename)
        mmproj = _mmproj_file(self.repo_id, files, self.options.mmproj)
        local = [self._download(name) for name in (*parts, *([mmproj] if mmproj else []))]
        return ResolvedModel(
            local[0],
            tuple(local[: len(parts)]),
            local[-1] if mmproj else None,
            self.repo_id,
            self.options.revision,
        )

    def _common(self) -> dict[str, Any]:
        o = self.options
        return {"revision": o.revision, "cache_dir": o.cache_dir, "token": o.token}

    def _list_files(self) -> list[str]:
        import huggingface_hub

        try:
            if self.offline:
                folder = huggingface_hub.snapshot_download(
                    self.repo_id, allow_patterns=["*.gguf"], local_files_only=True,
                    **self._common(),
                )  # fmt: skip
                return sorted(
                    p.relative_to(folder).as_posix() for p in Path(folder).rglob("*.gguf")
                )
            return list_files(
                self.endpoint, self.repo_id, self.options.revision, self.options.token
            )
        except Exception as error:
            raise _translate(
                self.repo_id, self.options, error, offline=bool(self.offline)
            ) from None

    @property
    def endpoint(self) -> str | None:
        """The option, else HF_ENDPOINT as it is now: huggingface_hub reads it once, when it is
        first imported, so a later change would otherwise go unseen."""
        return self.options.endpoint or os.environ.get("HF_ENDPOINT") or None

    def _download(self, filename: str) -> Path:
        import huggingface_hub

        try:
            with guarded_downloads():
                local = huggingface_hub.hf_hub_download(
                    self.repo_id, filename, endpoint=self.endpoint,
                    local_files_only=bool(self.offline), **self._common(),
                )  # fmt: skip
        except Exception as error:
            raise _translate(
                self.repo_id, self.options, error, offline=bool(self.offline)
            ) from None
        return Path(local)


def _model_files(repo_id: str, files: Sequence[str], pattern: str | None) -> list[str]:
    """The GGUF file to load (every part of it when split), chosen by ``pattern`` if needed."""
    candidates = [f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower()]
    if pattern is not None:
        candidates = [f for f in candidates if _matches(f, pattern)]
    models: dict[str, list[str]] = {}
    for name in candidates:
        split = _SPLIT.match(name)
        models.setdefault(split.group("stem") if split else name, []).append(name)
    if not models:
        wanted = f" matching {pattern!r}" if pattern else ""
        listing = ", ".join(f for f in files if f.endswith(".gguf")) or "none"
        raise HubError(f"{repo_id} has no GGUF model file{wanted} (GGUF files: {listing})")
    if len(models) > 1:
        choices = ", ".join(sorted(_display(parts) for parts in models.values()))
        raise HubError(f"{repo_id} has several GGUF models; pick one with filename=: {choices}")
    (parts,) = models.values()
    parts.sort()
    split = _SPLIT.match(parts[0])
    if split:
        count = int(split.group("count"))
        expected = [
            f"{split.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)
        ]
        missing = sorted(set(expected) - set(parts))
        if missing:
            raise HubError(f"{repo_id}: split model {parts[0]} lacks parts {', '.join(missing)}")
        return expected
    return parts


def _mmproj_file(repo_id: str, files: Sequence[str], wanted: bool | str) -> str | None:
    if wanted is False:
        return None
    found = [f for f in files if f.endswith(".gguf") and "mmproj" in f.lower()]
    if isinstance(wanted, str):
        found = [f for f in found if _matches(f, wanted)]
    if len(found) != 1:
        listing = ", ".join(found) or "none"
        raise HubError(f"{repo_id}: expected one mmproj file, found {listing}")
    return found[0]


def _matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(PurePosixPath(path).name, pattern)


def _display(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{sorted(parts)[0]} (+{len(parts) - 1} parts)"


def _translate(repo_id: str, options: HubOptions, error: Exception, offline: bool) -> HubError:
    """A HubError that says what went wrong, in our words and without the token."""
    from huggingface_hub import errors

    if isinstance(error, HubError):  # our own, already in our words
        return error
    where = f"{repo_id}" + (f" at revision {options.revision!r}" if options.revision else "")
    if isinstance(error, errors.GatedRepoError):
        message = f"{where} is gated: pass token= (or set HF_TOKEN) with access to it"
    elif isinstance(error, errors.RevisionNotFoundError):
        message = f"{where}: no such revision"
    elif isinstance(error, errors.RepositoryNotFoundError):
        message = f"{repo_id}: repository not found (or it needs a token)"
    elif isinstance(error, errors.EntryNotFoundError) and not offline:
        message = f"{where}: file not found"
    elif offline:
        message = f"{where} is not in the Hugging Face cache and offline mode is on"
    else:
        message = f"{where}: download failed ({type(error).__name__})"
    token = options.token if isinstance(options.token, str) else os.environ.get("HF_TOKEN")
    if token:
        message = message.replace(token, "***")
    return HubError(message)
