"""Media in chat messages: OpenAI ``image_url`` and ``input_audio`` content parts become the
projector's marker in the text, and Image / Audio inputs in the order they appear."""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamacrab._exceptions import MediaError
from llamacrab._native.media import Audio, Image, Media

MEDIA_PARTS = ("image_url", "input_audio")


@dataclass(frozen=True)
class MediaPolicy:
    """Where chat media may come from: ``data:`` URLs always; local files (paths or
    ``file://`` URLs) if ``local_files``; http(s) only if ``remote`` (off by default: a server
    must not fetch what a client names). At most ``max_media`` per request, each at most
    ``max_bytes``."""

    local_files: bool = True
    remote: bool = False
    max_media: int = 8
    max_bytes: int = 20 * 1024 * 1024
    timeout: float = 10.0

    def decoded(self, text: str) -> bytes:
        """A media item's bytes from base64, refused (MediaError) before decoding when they
        would exceed ``max_bytes``."""
        if len(text) * 3 // 4 > self.max_bytes:
            raise MediaError(f"a media item exceeds {self.max_bytes} bytes")
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("media data is not valid base64") from None


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(part, Mapping) and part.get("type") in MEDIA_PARTS
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def extract_media(
    messages: Sequence[Mapping[str, Any]], marker: str, policy: MediaPolicy
) -> tuple[list[dict[str, Any]], list[Media]]:
    """Messages whose media parts became ``marker`` text parts, and the media, in order."""
    media: list[Media] = []
    result = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            result.append(dict(message))
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in MEDIA_PARTS:
                if len(media) == policy.max_media:
                    raise MediaError(f"more than {policy.max_media} images/sounds in one request")
                media.append(_image(part, policy) if kind == "image_url" else _audio(part, policy))
                parts.append({"type": "text", "text": marker})
            else:
                parts.append(part)
        result.append({**message, "content": parts})
    return result, media


def _image(part: Mapping[str, Any], policy: MediaPolicy) -> Image:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if not isinstance(url, str) or not url:
        raise MediaError('an image_url part needs {"image_url": {"url": ...}}')
    return Image(data=_fetch(url, policy))


def _audio(part: Mapping[str, Any], policy: MediaPolicy) -> Audio:
    spec = part.get("input_audio")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("data"), str):
        raise MediaError('an input_audio part needs {"input_audio": {"data": BASE64, "format"}}')
    if spec.get("format", "wav") not in ("wav", "mp3", "flac"):
        raise MediaError(f"audio format {spec.get('format')!r} is not supported (wav, mp3, flac)")
    return Audio(data=policy.decoded(spec["data"]))


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise MediaError("data: URLs must be base64-encoded (data:image/png;base64,...)")
        return policy.decoded(payload)
    if scheme in ("http", "https"):
        if not policy.remote:
            raise MediaError("remote media URLs are disabled (allow them with MediaPolicy)")
        from urllib.request import urlopen  # only where remote media are allowed

        with urlopen(url, timeout=policy.timeout) as response:
            data: bytes = response.read(policy.max_bytes + 1)
        if len(data) > policy.max_bytes:
            raise MediaError(f"{url} exceeds {policy.max_bytes} bytes")
        return data
    if scheme not in ("", "file"):
        raise MediaError(f"unsupported media URL scheme {scheme!r}")
    if not policy.local_files:
        raise MediaError("local media files are not allowed here: send a data: URL")
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path) if scheme else url)
    if not path.is_file():
        raise MediaError(f"no media file {path}")
    if path.stat().st_size > policy.max_bytes:
        raise MediaError(f"{path} exceeds {policy.max_bytes} bytes")
    return path.read_bytes()
