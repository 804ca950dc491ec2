"""Multimodal prompts: text with one marker per image or sound, tokenized into chunks by the
projector, within the limits of a MediaPolicy."""

from __future__ import annotations

from collections.abc import Sequence

from llamacrab._chat.media_parts import MediaPolicy
from llamacrab._exceptions import ContextOverflowError, InvalidParameterError, MediaError
from llamacrab._features.sound_tokens import SoundTokens
from llamacrab._native.media import Audio, Media, encoded_media
from llamacrab._native.mtmd import Bitmap, Chunks, Projector


class MediaInput:
    """A Llama's projector (if any), the policy its media obey, and the tokens one sequence
    of its context holds (``n_ctx``)."""

    def __init__(self, projector: Projector | None, policy: MediaPolicy, n_ctx: int) -> None:
        self._projector = projector
        self.policy = policy
        self.n_ctx = n_ctx
        self._sound_tokens = None if projector is None else SoundTokens(projector)

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
        file), as chunks. Sounds that cannot fit the context are refused before libmtmd
        computes their spectrograms (ContextOverflowError)."""
        projector = self.projector
        if len(media) > self.policy.max_media:
            raise MediaError(f"more than {self.policy.max_media} images/sounds at once")
        items = [encoded_media(item) if isinstance(item, bytes) else item for item in media]
        bitmaps = [projector.bitmap(item) for item in items]
        try:
            self._check_sounds_fit([b for item, b in zip(items, bitmaps, strict=True)
                                    if isinstance(item, Audio)])  # fmt: skip
            return projector.tokenize(text, bitmaps, add_special, parse_special)
        finally:
            for bitmap in bitmaps:
                bitmap.close()  # the chunks hold what they need

    def _check_sounds_fit(self, sounds: Sequence[Bitmap]) -> None:
        if not sounds:
            return
        assert self._sound_tokens is not None and self.projector.sample_rate is not None
        lengths = [sound.n_bytes // 4 for sound in sounds]  # float32 samples
        tokens = self._sound_tokens.at_least(lengths, self.n_ctx)
        if tokens >= self.n_ctx:
            seconds = sum(lengths) / self.projector.sample_rate
            raise ContextOverflowError(
                f"the prompt's sound ({seconds:.0f} s) becomes at least {tokens} tokens; the "
                f"context holds {self.n_ctx}",
                n_prompt_tokens=tokens, n_ctx=self.n_ctx,
            )  # fmt: skip
