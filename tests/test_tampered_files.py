"""Files tampered at random in their header never abort or hang the process.

Each copy of the tiny model has a few bytes of its metadata or tensor-info region overwritten.
llama.cpp rejects most such files cleanly and asserts (aborting the process) on some; the
validation in front of it must turn every one into an exception or a working model. All copies
are loaded in one child process, so an abort shows up as its exit status.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

N_COPIES = 60

CHILD = textwrap.dedent("""
    import json, sys
    from llamacrab import Llama, LlamaError
    outcomes = {}
    for path in sys.argv[1:]:
        try:
            with Llama(path, n_ctx=64, n_threads=1) as llm:
                llm.create_completion("the cat", max_tokens=2, temperature=0)
            outcomes[path] = "loaded"
        except LlamaError as error:
            outcomes[path] = type(error).__name__
    print(json.dumps(outcomes))
""")


def header_size(path: Path) -> int:
    """Bytes before the tensor data: magic, counts, metadata and tensor infos."""
    import gguf

    reader = gguf.GGUFReader(path)
    return int(reader.data_offset)


def test_randomly_tampered_headers_raise_or_load(tmp_path: Path, tiny_model_path: Path) -> None:
    data = tiny_model_path.read_bytes()
    end = header_size(tiny_model_path)
    rng = random.Random(1234)
    paths = []
    for i in range(N_COPIES):
        copy = bytearray(data)
        for _ in range(rng.choice((1, 2, 4))):
            position = rng.randrange(24, end)  # after magic, version and counts
            copy[position] = rng.choice((0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        path = tmp_path / f"tampered-{i}.gguf"
        path.write_bytes(bytes(copy))
        paths.append(str(path))
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, *paths], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, f"the process died: {result.returncode}\n{result.stderr[-3000:]}"
    outcomes = json.loads(result.stdout)
    assert len(outcomes) == N_COPIES
    print({kind: list(outcomes.values()).count(kind) for kind in set(outcomes.values())})
