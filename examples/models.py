"""Several models in one process: a ModelRegistry, then the same registry file served.

Usage: python examples/models.py [MODEL.gguf]
Two entries share one GGUF here (a chat model and an embeddings context over it); in practice
each names its own file or org/repo. Needs ``pip install 'llamacrab[server]' openai`` for the
server part. Without a model: Gemma 3 270M from PyPI.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from llamacrab import ModelRegistry, estimate_memory
from llamacrab.cli import default_model

REGISTRY = """
max_loaded = 1          # one model in memory at a time: the least recently used unloads
keep_alive = 300        # seconds an idle model stays loaded

[models.chat]
model = "{model}"
preset = "low-ram"      # named options; the entry's own options override them
n_ctx = 1024

[models.embed]
model = "{model}"
embeddings = true
pooling = "mean"
"""


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else default_model()
    print(f"chat estimate: {estimate_memory(model, preset='low-ram', n_ctx=1024).total >> 20} MiB")
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "models.toml"
        config.write_text(REGISTRY.format(model=Path(model).as_posix()))
        with ModelRegistry.from_toml(config) as registry:
            with registry.use("chat") as llm:  # loads on first use; in use inside the block
                answer = llm.create_completion("Paris is the capital of", max_tokens=3,
                                               temperature=0)  # fmt: skip
                print("chat:", repr(answer.text))
            vector = registry.get("embed").embed("a crab on the beach")
            print("embedding:", vector.shape)
            states = ", ".join(f"{e.name} {e.status}" for e in registry.entries())
            print("after loading embed:", states)
        serve(config)


def serve(config: Path) -> None:
    """``llamacrab serve --models models.toml``: requests choose their model by name."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "llamacrab", "serve", "--models", str(config),
               "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health")
                break
            except OSError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        print("served:", [(m.id, (m.model_extra or {})["status"]["value"])
                          for m in client.models.list()])  # fmt: skip
        chat = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
            temperature=0,
        )  # fmt: skip
        print("served chat:", repr(chat.choices[0].message.content))
        vectors = client.embeddings.create(model="embed", input="a crab")
        print("served embedding:", len(vectors.data[0].embedding), "floats")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
