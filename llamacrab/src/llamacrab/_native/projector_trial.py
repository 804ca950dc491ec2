"""The child side of ``projector_probe``: ``python -m llamacrab._native.projector_trial MODEL
PROJECTOR`` loads the projector as ``Projector`` does (on the CPU, for the text model's
vocabulary alone) and encodes a small grey image and a second of silence with it, as far as
it takes them. Exit status 0 when that worked, 1 when llamacrab or libmtmd refused something
(the load in the parent then reports its own refusal); any other status, or a signal, is a
death, and the parent's answer (``projector_probe.LIVED``).
"""

from __future__ import annotations

import sys

import numpy as np

from llamacrab._exceptions import LlamaError
from llamacrab._native.call import call, lib
from llamacrab._native.media import Audio, Image, Media
from llamacrab._native.model import Model, ModelParams
from llamacrab._native.mtmd import Projector, chunk_pointers


def trial(model_path: str, projector_path: str) -> int:
    model = Model.load(model_path, ModelParams(vocab_only=True))
    projector = Projector(model, projector_path, n_threads=1, use_gpu=False, probe=False)
    inputs: list[Media] = []
    if projector.vision:
        inputs.append(Image(pixels=np.full((32, 32, 3), 128, np.uint8)))
    if projector.audio and projector.sample_rate:
        rate = projector.sample_rate
        inputs.append(Audio(samples=np.zeros(rate, np.float32), sample_rate=rate))
    for media in inputs:
        chunks = projector.tokenize(f"{projector.marker} .", [projector.bitmap(media)])
        with projector.in_flight() as pointer, chunks.in_flight() as chunk_list:
            for chunk in chunk_pointers(chunk_list):
                text = lib.mtmd_input_chunk_get_type(chunk) == lib.MTMD_INPUT_CHUNK_TYPE_TEXT
                if not text and call("mtmd_encode_chunk", pointer, chunk) != 0:
                    return 1
    return 0


def main() -> None:
    try:
        status = trial(sys.argv[1], sys.argv[2])
    except LlamaError:
        status = 1
    sys.exit(status)


if __name__ == "__main__":
    main()
