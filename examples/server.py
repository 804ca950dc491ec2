"""The OpenAI-compatible server, driven by the official openai SDK.

Usage: python examples/server.py [MODEL.gguf]
It starts ``llamacrab serve`` on a free loopback port (as you would in a shell:
``llamacrab serve MODEL --parallel 4``), then talks to it like any OpenAI endpoint.
Needs ``pip install 'llamacrab[server]' openai``. Without a model: Gemma 3 270M from PyPI.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import openai

from llamacrab.cli import default_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_ready(url: str) -> None:
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health") as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else default_model()
    port = free_port()
    command = [sys.executable, "-m", "llamacrab", "serve", model, "--port", str(port),
               "--parallel", "4", "--model-alias", "local", "--api-key", "example-key"]  # fmt: skip
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="example-key")
        print("models:", [m.id for m in client.models.list()])
        completion = client.completions.create(model="local", prompt="Paris is the capital of",
                                               max_tokens=4, temperature=0)  # fmt: skip
        print("completion:", repr(completion.choices[0].text))
        stream = client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=12, temperature=0, stream=True,
        )  # fmt: skip
        print("streamed chat:", repr("".join(c.choices[0].delta.content or "" for c in stream)))
        # The Responses API: the server keeps the conversation for previous_response_id.
        first = client.responses.create(model="local", instructions="Answer in a few words.",
                                        input="What is the capital of France?",
                                        max_output_tokens=8, temperature=0)  # fmt: skip
        print("response:", repr(first.output_text))
        follow_up = client.responses.create(model="local", previous_response_id=first.id,
                                            input="And of Italy?", max_output_tokens=8,
                                            temperature=0)  # fmt: skip
        print("follow-up:", repr(follow_up.output_text))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
