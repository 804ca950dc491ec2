"""Multimodal prompts: text with one marker per image or sound, tokenized into chunks by the
projector, within the limits of a MediaPolicy."""

from __future__ import annotations

from collections.abc import Sequence

from llamacrab._chat.media_parts import MediaPolicy
from llamacrab._exceptions import InvalidParameterError, MediaError
from llamacrab._native.media import Media, encoded_media
from llamacrab._native.mtmd import Chunks, Projector


class MediaInput:
    """A Llama's projector (if any) and the policy its media obey."""

    def __init__(self, projector: Projector | None, policy: MediaPolicy) -> None:
        self._projector = projector
        self.policy = policy

    @property
    def projector(self) -> Projector:
        if self._projector is None:
            raise InvalidParameterError(
                "this model takes no images or sounds: it needs a projector, mmproj= (a "
                "server's --mmproj)"
            )
        return self._projector

    def check_own(self, chunks: Chunks) -> None:
        """Refuse a prompt tokenized by another Llama's projector (its media would be encoded
        for another model)."""
        if chunks.projector is not self.projector:
            raise InvalidParameterError(
                "this multimodal prompt was tokenized by another Llama's projector: make it "
                "with this Llama's tokenize_media"
            )

    def tokenize(
        self, text: str, media: Sequence[Media | bytes], add_special: bool, parse_special: bool
    ) -> Chunks:
        """``text`` with one marker per item of ``media`` (bytes: an encoded image or sound
        file), as chunks."""
        projector = self.projector
        if len(media) > self.policy.max_media:
            raise MediaError(f"more than {self.policy.max_media} images/sounds at once")
        items = [encoded_media(item) if isinstance(item, bytes) else item for item in media]
        bitmaps = [projector.bitmap(item) for item in items]
        try:
            return projector.tokenize(text, bitmaps, add_special, parse_special)
        finally:
            for bitmap in bitmaps:
                bitmap.close()  # the chunks hold what they need
