"""What a hub endpoint's answers may make us do: list a bounded repository and write nothing
outside the cache.

An endpoint (HF_ENDPOINT, a mirror, anything on a plain-http path) is trusted with the bytes of
the model, which the GGUF checks read before llama.cpp does, and with nothing else. Two of its
answers reach file paths unchecked in huggingface_hub (seen in 2.4.0): a download's ETag names
the cache blob (``blobs/<etag>``: an ETag "/home/me/.bashrc" writes the download there) and a
404's X-Repo-Commit names the directory of the "file does not exist" marker. Its listing
follows the server's "next" links without end, sending the token wherever they point. And a
rate-limited answer (429) is retried after whatever wait it names (Retry-After, or RateLimit's
reset), five times: a day each, if the endpoint says so; a number too long for ``int()`` raised
ValueError, one too large for ``time.sleep`` OverflowError.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from llamacrab._exceptions import HubError
from llamacrab._native.fork import reset_in_child

# A repository larger than this is not a GGUF model's (the Hub's largest hold a few thousand).
MAX_FILES = 100_000
MAX_PAGES = 1_000
# A listing answered slowly page after page (each within the request timeout) ends here too.
MAX_LISTING_SECONDS = 300.0
# The longest wait between retries a rate-limited answer may ask for; a longer one is a
# HubError at once, naming the wait (the Hub's windows are 300 s: many honest waits are refused).
MAX_RETRY_WAIT = 60
# One path component, as every ETag and commit hash the Hub sends is (hex digits).
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")

_guarded: ContextVar[bool] = ContextVar("llamacrab_hub_guarded", default=False)
_install_lock = threading.Lock()
reset_in_child(_install_lock)  # a thread holding it at fork() is not in the child


@contextmanager
def guarded_downloads() -> Iterator[None]:
    """huggingface_hub downloads made inside refuse an ETag or commit hash that is not a plain
    name, before anything is written (other code's downloads are left as they are)."""
    _install()
    token = _guarded.set(True)
    try:
        yield
    finally:
        _guarded.reset(token)


def list_files(endpoint: str | None, repo_id: str, revision: str | None, token: Any) -> list[str]:
    """Every file path of ``repo_id`` at ``revision``, as HfApi.list_repo_files gives them,
    through at most MAX_PAGES pages and MAX_FILES files of the endpoint's origin, within
    MAX_LISTING_SECONDS."""
    from huggingface_hub import constants

    # (public, documented names that huggingface_hub.utils exports lazily: mypy cannot see them)
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        build_hf_headers,
        get_session,
        hf_raise_for_status,
    )

    base = (endpoint or constants.ENDPOINT).rstrip("/")
    url = f"{base}/api/models/{repo_id}/tree/{quote(revision or 'main', safe='')}"
    params: dict[str, str] | None = {"recursive": "true", "expand": "false"}
    headers = build_hf_headers(token=token)
    files: list[str] = []
    deadline = time.monotonic() + MAX_LISTING_SECONDS
    for _ in range(MAX_PAGES):
        if time.monotonic() > deadline:
            raise HubError(f"{repo_id}: the hub's listing took more than {MAX_LISTING_SECONDS} s")
        response = get_session().get(
            url, params=params, headers=headers, timeout=constants.DEFAULT_REQUEST_TIMEOUT
        )
        hf_raise_for_status(response)
        page = _paths(repo_id, response)
        files += page
        if len(files) > MAX_FILES:
            raise HubError(f"{repo_id}: the hub lists more than {MAX_FILES} files")
        following = response.links.get("next", {}).get("url")
        if following is None:
            return files
        if not page:
            raise HubError(f"{repo_id}: the hub's listing has an empty page that is not its last")
        url, params = urljoin(url, following), None
        if _origin(url) != _origin(base):
            raise HubError(f"{repo_id}: the hub's listing continues on another host ({url})")
    raise HubError(f"{repo_id}: the hub's listing runs past {MAX_PAGES} pages")


def _paths(repo_id: str, response: Any) -> list[str]:
    try:
        entries = response.json()
    except ValueError:
        raise HubError(f"{repo_id}: the hub's listing is not JSON") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise HubError(f"{repo_id}: the hub's listing is not a list of entries")
    paths = [e.get("path") for e in entries if e.get("type") == "file"]
    for path in paths:
        if not isinstance(path, str) or not _is_relative_path(path):
            raise HubError(f"{repo_id}: the hub lists an unsafe file name {path!r:.200}")
    return paths


def _is_relative_path(path: str) -> bool:
    parts = path.split("/")
    return all(part not in ("", ".", "..") for part in parts) and not any(c in path for c in "\\\0")


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def _install() -> None:
    """Wrap, once per process, huggingface_hub's file-metadata request, through which every
    download's ETag and commit hash pass (a 404's too), and the two readers of a 429's wait
    that its retries call (absent before 1.0, which waited at most 8 s)."""
    from huggingface_hub import file_download
    from huggingface_hub.utils import _http

    with _install_lock:
        original = file_download.get_hf_file_metadata
        if not getattr(original, "_llamacrab_guard", False):
            file_download.get_hf_file_metadata = _checking(original)
        for name in ("_parse_retry_after", "parse_ratelimit_headers"):
            reader = getattr(_http, name, None)
            if reader is not None and not getattr(reader, "_llamacrab_guard", False):
                setattr(_http, name, _bounding_wait(reader))


def _checking(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not _guarded.get():
            return original(*args, **kwargs)
        try:
            metadata = original(*args, **kwargs)
        except Exception as error:
            response = getattr(error, "response", None)
            if response is not None:
                _check_name("X-Repo-Commit", response.headers.get("X-Repo-Commit"))
            raise
        _check_name("ETag", metadata.etag)
        _check_name("X-Repo-Commit", metadata.commit_hash)
        return metadata

    checked._llamacrab_guard = True  # type: ignore[attr-defined]
    return checked


def _bounding_wait(reader: Callable[..., Any]) -> Callable[..., Any]:
    """``reader`` (of a response's headers: seconds, a RateLimitInfo or None) refusing a wait
    over MAX_RETRY_WAIT seconds, or one that is not a number, inside guarded downloads."""

    @functools.wraps(reader)
    def bounded(headers: Any) -> Any:
        if not _guarded.get():
            return reader(headers)
        try:
            answer = reader(headers)
        except ValueError as error:  # more digits than int() reads
            raise HubError("the hub asked to wait a number of seconds too long to read") from error
        if answer is None or isinstance(answer, int):
            wait = answer
        else:  # a RateLimitInfo: a wait only once nothing remains
            wait = answer.reset_in_seconds if answer.remaining == 0 else None
        if wait is not None and wait > MAX_RETRY_WAIT:
            shown = f"{wait} s" if wait < 10**9 else "over 10**9 s"
            raise HubError(
                f"the hub is rate-limiting these requests for {shown}, longer than the "
                f"{MAX_RETRY_WAIT} s llamacrab waits between retries: try again later"
            )
        return answer

    bounded._llamacrab_guard = True  # type: ignore[attr-defined]
    return bounded


def _check_name(header: str, value: str | None) -> None:
    if value is not None and not _SAFE_NAME.fullmatch(value):
        raise HubError(
            f"the hub answered an {header} that is not a plain name ({value!r:.200}); "
            "huggingface_hub would use it as a path: refused"
        )
