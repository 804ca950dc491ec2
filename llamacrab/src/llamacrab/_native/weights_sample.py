"""A digest of bytes sampled across a model's files, for telling apart models whose metadata
and layout agree: two fine-tunes of one base differ in nearly every block of their weights,
but in none of the header a digest of the metadata covers. Hashing every byte would read the
whole model at load (tens of GB); a few hundred spread-out blocks read a few hundred KiB."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

SAMPLES = 256  # per file: blocks of BLOCK bytes, evenly spaced from the start to the end
BLOCK = 4096


def weights_sample(parts: Sequence[Path]) -> bytes:
    """SHA-256 over each file's size and its sampled blocks (the whole file when smaller)."""
    digest = hashlib.sha256()
    for part in parts:
        with part.open("rb") as file:
            size = file.seek(0, 2)
            digest.update(size.to_bytes(8, "little"))
            span = max(size - BLOCK, 0)
            for i in range(SAMPLES):
                file.seek(span * i // (SAMPLES - 1))
                digest.update(file.read(BLOCK))
    return digest.digest()
