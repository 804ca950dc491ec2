"""How many tokens sounds become at the least, known before libmtmd computes their spectrograms.

mtmd_tokenize computes a sound's whole mel spectrogram in one call that nothing interrupts (a
Ctrl-C, ``close()``, a client that left): about 3.5 ms per second of sound on one core, 12 s for
the hour a 12 kB FLAC can declare, before a context of 2,048 tokens refused its 90,000. The
embeddings a sound becomes depend on its length alone and never shrink as it grows (libmtmd
cuts sounds into windows by sample count), so silence of a probe length, counted once per
projector, bounds from below every sound at least as long. Probes double from 30 s (Whisper's
window) until the bound reaches the context, or the sounds, at the rate the last probe showed,
look like they fit: probing costs about a context's worth of sound, once, and a refusal after
that costs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from llamacrab._native.mtmd import Projector

FIRST_PROBE_SECONDS = 30


class SoundTokens:
    """A projector's counts of silence, by length in samples, and the bounds they give."""

    def __init__(self, projector: Projector) -> None:
        self._projector = projector
        self._counts: dict[int, int] = {}  # probed length in samples: its tokens
        self._lock = threading.Lock()  # one thread probes; the others find its counts

    def at_least(self, sounds: Sequence[int], limit: int) -> int:
        """Tokens that sounds of these lengths (in samples) become together, at the least;
        probes stop once the bound reaches ``limit``."""
        rate = self._projector.sample_rate
        if not sounds or rate is None:
            return 0
        probe = FIRST_PROBE_SECONDS * rate
        with self._lock:
            while probe <= max(sounds):
                tokens = self._counts.get(probe)
                if tokens is None:
                    tokens = self._counts[probe] = self._projector.silence_tokens(probe)
                if self._bound(sounds) >= limit or sum(sounds) * tokens < limit * probe:
                    break
                probe *= 2
            return self._bound(sounds)

    def _bound(self, sounds: Sequence[int]) -> int:
        """Each sound counts as the longest probe it outlasts (counts grow with length)."""
        return sum(
            max((tokens for length, tokens in self._counts.items() if length <= n), default=0)
            for n in sounds
        )
