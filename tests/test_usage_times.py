"""Usage times say what the engine did, not when a consumer read it: parallel slots generate on
their own thread, ahead of a consumer that may read the steps late."""

from __future__ import annotations

import time
from pathlib import Path

from llamacrab import Llama

LATE_BY = 2.0


def test_a_late_reader_does_not_count_as_generation_time(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=2) as llm:
        stream = llm.stream_completion("the cat sat on", max_tokens=6, temperature=0.0,
                                       min_tokens=6)  # fmt: skip
        chunks = [next(stream)]
        first_read = time.monotonic()
        while any(slot.busy for slot in llm.slots()):  # the engine generates the rest
            time.sleep(0.01)
        done_within = time.monotonic() - first_read
        time.sleep(LATE_BY)  # ... and the rest is read this much later
        chunks.extend(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    # Read LATE_BY after the engine was done, it took at most done_within to make them (the
    # 10 ms polls' slack aside): a reader's clock counted LATE_BY more. Five steps after the
    # first took some time.
    assert 0 < usage.generation_seconds <= done_within + 0.05, (usage, done_within)
