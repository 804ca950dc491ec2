"""The server's model flags (adapters, control vectors, speculative decoding, caches, KV types,
rope) as Llama keywords, LoRA adapters per request on parallel slots, and /lora-adapters."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer

from llamacrab import DecodeError, InvalidParameterError, Llama
from llamacrab.server import ServerSettings, parse_settings
from llamacrab.server._errors import from_llama_error
from llamacrab.server._llama_kwargs import llama_kwargs

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

PROMPT = "the cat sat on the mat"
GREEDY = {"max_tokens": 10, "temperature": 0.0}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("server-adapters")
    return {
        "lora": tiny.write_tiny_lora(d / "lora.gguf"),
        "lora2": tiny.write_tiny_lora(d / "lora2.gguf", seed=7),
        "alora": tiny.write_tiny_lora(d / "alora.gguf", seed=5, invocation_tokens=[5, 6]),
        "cvec": tiny.write_tiny_control_vector(d / "cvec.gguf"),
        "draft": tiny.write_tiny_draft(d / "draft.gguf", tiny_model_path),
    }


# -- flags -> Llama keywords -------------------------------------------------------------------


def test_every_model_flag_becomes_a_llama_keyword(tmp_path: Path) -> None:
    settings = parse_settings([
        "m.gguf", "--lora", "a.gguf,b.gguf", "--lora-scaled", "c.gguf:0.5",
        "--control-vector", "v.gguf", "--control-vector-scaled", "w.gguf:-1.5",
        "--control-vector-layer-range", "2", "5", "--lookup-ngram", "3", "--draft-max", "12",
        "--cache-disk", str(tmp_path), "--cache-disk-size", "64", "--cache-type-k", "q8_0",
        "--cache-type-v", "q8_0", "--rope-scaling", "yarn", "--rope-freq-base", "20000",
        "--rope-freq-scale", "0.5", "--yarn-orig-ctx", "2048", "--yarn-ext-factor", "1.0",
    ], environ={})  # fmt: skip
    kwargs = llama_kwargs(settings)
    assert kwargs["lora"] == (("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 0.5))
    assert kwargs["control_vectors"] == (("v.gguf", 1.0), ("w.gguf", -1.5))
    assert kwargs["control_vector_layers"] == (2, 5)
    assert (kwargs["prompt_lookup"], kwargs["draft_max"]) == (3, 12)
    assert "parallel" not in kwargs  # speculative decoding: one slot
    assert kwargs["prompt_cache"] == str(tmp_path) and kwargs["prompt_cache_bytes"] == 64 << 20
    assert (kwargs["type_k"], kwargs["type_v"], kwargs["rope_scaling"]) == ("q8_0", "q8_0", "yarn")
    assert (kwargs["rope_freq_base"], kwargs["rope_freq_scale"]) == (20000.0, 0.5)
    assert (kwargs["yarn_orig_ctx"], kwargs["yarn_ext_factor"]) == (2048, 1.0)
    ram = llama_kwargs(parse_settings(["m.gguf", "--cache-ram", "16"], environ={}))
    assert (ram["prompt_cache"], ram["prompt_cache_bytes"]) == ("ram", 16 << 20)
    assert "prompt_cache" not in llama_kwargs(parse_settings(["m", "--cache-ram", "0"], environ={}))
    env = {"LLAMACRAB_LORA": "x.gguf,y.gguf", "LLAMACRAB_CONTROL_VECTOR_LAYER_RANGE": "1,3",
           "LLAMACRAB_CONTROL_VECTOR": "v.gguf", "LLAMACRAB_MODEL_DRAFT": "d.gguf"}  # fmt: skip
    from_env = llama_kwargs(parse_settings([], environ={**env, "LLAMACRAB_MODEL": "m.gguf"}))
    assert from_env["lora"] == (("x.gguf", 1.0), ("y.gguf", 1.0))
    assert from_env["control_vector_layers"] == (1, 3)
    assert from_env["draft_model"] == "d.gguf"


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--lora-scaled", "a.gguf"], "FILE:SCALE"),
        (["--lora-scaled", "a.gguf:big"], "FILE:SCALE"),
        (["--control-vector-layer-range", "1", "2"], "needs --control-vector"),
        (["--model-draft", "d.gguf", "--parallel", "2"], "--parallel 1"),
        (["--model-draft", "d.gguf", "--lookup-ngram", "2"], "not both"),
        (["--draft-max", "4"], "needs --model-draft"),
        (["--cache-ram", "8", "--cache-disk", "."], "not both"),
        (["--embeddings", "--lora", "a.gguf"], "for generation"),
    ],
)
def test_model_flags_that_cannot_work_are_refused_at_start(flags: list[str], match: str) -> None:
    settings = parse_settings(["m.gguf", *flags], environ={})
    with pytest.raises(InvalidParameterError, match=match):
        llama_kwargs(settings)
    from llamacrab.server import create_app

    with pytest.raises(InvalidParameterError, match=match):
        create_app(settings)


# -- a live server -----------------------------------------------------------------------------


def _running(settings: ServerSettings) -> Iterator[LiveServer]:
    server = LiveServer(settings)
    try:
        server.wait_until_loaded()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def lora_server(tiny_model_path: Path, files: dict[str, Path]) -> Iterator[LiveServer]:
    settings = ServerSettings(
        model=str(tiny_model_path), n_ctx=2 * 256, n_threads=2, parallel=2, chat_template="chatml",
        lora=(str(files["lora"]),), lora_scaled=(f"{files['lora2']}:0", f"{files['alora']}:0"),
    )  # fmt: skip
    yield from _running(settings)


def _reference(tiny_model_path: Path, files: dict[str, Path]) -> dict[str, str]:
    """Greedy texts of the Python API, one slot, for the default set, adapter 1 alone, none."""
    lora = [(str(files["lora"]), 1.0), (str(files["lora2"]), 0.0)]
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, lora=lora) as llm:
        one, two = llm.adapters
        sets = {"default": None, "second": {one: 0.0, two: 0.5}, "none": {}}
        return {name: llm.create_completion(PROMPT, lora=s, **GREEDY).text
                for name, s in sets.items()}  # fmt: skip


def test_lora_adapters_are_listed_as_llama_server_lists_them(
    lora_server: LiveServer, files: dict[str, Path]
) -> None:
    adapters = httpx.get(lora_server.url + "/lora-adapters").json()
    assert [(a["id"], a["path"], a["scale"]) for a in adapters] == [
        (0, str(files["lora"]), 1.0), (1, str(files["lora2"]), 0.0), (2, str(files["alora"]), 0.0)
    ]  # fmt: skip
    assert {"task_name", "prompt_prefix"} <= set(adapters[0])
    assert "alora_invocation_tokens" not in adapters[0]
    assert adapters[2]["alora_invocation_tokens"] == [5, 6]
    assert isinstance(adapters[2]["alora_invocation_string"], str)


def test_lora_per_request_on_two_parallel_slots(
    lora_server: LiveServer, tiny_model_path: Path, files: dict[str, Path]
) -> None:
    reference = _reference(tiny_model_path, files)
    assert len(set(reference.values())) == 3
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    bodies = {"default": None, "second": [{"id": 1, "scale": 0.5}], "none": [{"id": 0, "scale": 0}]}
    for _ in range(2):  # the second round reuses the slots' prompts where it may
        results: dict[str, str] = {}
        start = threading.Barrier(3)

        def run(name: str, results: dict[str, str], start: threading.Barrier) -> None:
            extra = {} if bodies[name] is None else {"lora": bodies[name]}
            start.wait()
            answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                               temperature=0.0, extra_body=extra)  # fmt: skip
            results[name] = answer.choices[0].text

        threads = [threading.Thread(target=run, args=(name, results, start)) for name in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == reference
    # Chat takes the field too.
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"lora": [{"id": 1, "scale": 0.5}]},
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_lora_per_request_on_the_responses_and_anthropic_routes(lora_server: LiveServer) -> None:
    url, lora = lora_server.url, [{"id": 1, "scale": 0.5}]
    messages = [{"role": "user", "content": "the cat sat"}]

    def chat(extra: dict[str, Any]) -> str:
        body = {"messages": messages, "max_tokens": 10, "temperature": 0.0, **extra}
        answer = httpx.post(url + "/v1/chat/completions", json=body).json()
        return str(answer["choices"][0]["message"]["content"])

    def responses(extra: dict[str, Any]) -> str:
        body = {"input": "the cat sat", "max_output_tokens": 10, "temperature": 0.0, **extra}
        answer = httpx.post(url + "/v1/responses", json=body).json()
        return str(answer["output"][0]["content"][0]["text"])

    def anthropic(extra: dict[str, Any]) -> str:
        body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0.0,
                **extra}  # fmt: skip
        return str(httpx.post(url + "/v1/messages", json=body).json()["content"][0]["text"])

    default, second = chat({}), chat({"lora": lora})
    assert default != second  # the adapter set changes this answer
    for route in (responses, anthropic):
        assert (route({}), route({"lora": lora})) == (default, second), route.__name__
    unknown = {"lora": [{"id": 9, "scale": 1.0}], "max_tokens": 4}
    answer = httpx.post(url + "/v1/responses", json={"input": "hi", **unknown})
    assert answer.status_code == 400 and "no LoRA adapter with id 9" in answer.text
    answer = httpx.post(url + "/v1/messages", json={"model": "tiny", "messages": messages,
                                                     **unknown})  # fmt: skip
    assert answer.status_code == 400 and answer.json()["type"] == "error"
    assert "no LoRA adapter with id 9" in answer.json()["error"]["message"]


def test_a_request_naming_an_unknown_adapter_is_a_400(lora_server: LiveServer) -> None:
    response = httpx.post(lora_server.url + "/v1/completions",
                          json={"prompt": PROMPT, "lora": [{"id": 7, "scale": 1.0}]})  # fmt: skip
    assert response.status_code == 400
    assert "no LoRA adapter with id 7" in response.json()["error"]["message"]
    response = httpx.post(lora_server.url + "/lora-adapters", json=[{"id": -1, "scale": 1.0}])
    assert response.status_code == 400


def test_a_lora_scale_that_overflows_the_logits_is_a_400_naming_it(
    lora_server: LiveServer, tiny_model_path: Path, files: dict[str, Path]
) -> None:
    # The logits came out NaN (the library's DecodeError) and every route answered 500. 3e38
    # makes the adapter's delta infinite in float32, NaN on every kernel path: 1e30 came out
    # NaN or finite nonsense by the rows of a decode (the CPU's flash attention keeps 64 rows
    # and more in float32), and an end token picked first from the nonsense answered 200.
    url, huge = lora_server.url, [{"id": 0, "scale": 3e38}]
    said = [{"role": "user", "content": PROMPT}]
    requests = [
        ("/completion", {"prompt": PROMPT, "n_predict": 4}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": said, "max_tokens": 4}),
        ("/v1/responses", {"input": PROMPT, "max_output_tokens": 4}),
    ]
    for path, body in requests:
        for stream in (False, True):
            answer = httpx.post(url + path, json={**body, "lora": huge, "stream": stream},
                                timeout=60)  # fmt: skip
            assert answer.status_code == 400, f"{path} stream={stream}: {answer.text}"
            error = answer.json()["error"]
            assert error["param"] == "lora" and error["code"] == "lora_scale_overflow"
            assert "adapter 0 at scale 3e+38" in error["message"], error
    claude = httpx.post(url + "/v1/messages", json={"model": "tiny", "messages": said,
                                                    "max_tokens": 4, "lora": huge})  # fmt: skip
    assert claude.status_code == 400 and "scale 3e+38" in claude.json()["error"]["message"]
    # Not a number at all: refused before anything runs.
    for scale in (b"NaN", b"Infinity", b"1e999"):
        body = b'{"prompt": "hi", "lora": [{"id": 0, "scale": %s}]}' % scale
        answer = httpx.post(url + "/v1/completions", content=body,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == 400, (scale, answer.text)
    # The slots serve on, from memory computed with the scales asked for.
    text = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
    assert text.json()["choices"][0]["text"] == _reference(tiny_model_path, files)["default"]
    # ... and none of the NaN a prompt left is read again: freed cells kept it, attention reads
    # freed cells through its mask, and a shorter prompt on that slot answered 500 (NaN).
    words = "a dog ran far away from the old red barn "
    long_prompt, shorter = words * 5, " ".join(reversed((words * 3).split()))
    answer = httpx.post(url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 4,
                                                       "lora": huge}, timeout=60)  # fmt: skip
    assert answer.status_code == 400, answer.text
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, lora=[str(files["lora"])]) as llm:
        expected = llm.create_completion(shorter, **GREEDY).text
    text = httpx.post(url + "/v1/completions", json={"prompt": shorter, **GREEDY}, timeout=60)
    assert text.status_code == 200 and text.json()["choices"][0]["text"] == expected, text.text
    # The same scales as the defaults: refused alike (POST answered 200 and every later request
    # 500), the defaults kept.
    before = httpx.get(url + "/lora-adapters").json()
    answer = httpx.post(url + "/lora-adapters", json=huge, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "lora_scale_overflow"
    assert httpx.get(url + "/lora-adapters").json() == before
    text = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
    assert text.json()["choices"][0]["text"] == _reference(tiny_model_path, files)["default"]


def test_logits_that_overflow_under_the_servers_own_scales_are_its_error() -> None:
    # Scales from --lora-scaled: no request asked for them.
    error = from_llama_error(DecodeError("NaN logits", status=0))
    assert error.status == 500


def test_post_lora_adapters_sets_the_default_scales(
    lora_server: LiveServer, tiny_model_path: Path, files: dict[str, Path]
) -> None:
    reference = _reference(tiny_model_path, files)
    url = lora_server.url
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0}
    try:
        answer = httpx.post(url + "/lora-adapters", json=[{"id": 1, "scale": 0.5}])
        assert answer.json() == {"success": True}
        scales = [a["scale"] for a in httpx.get(url + "/lora-adapters").json()]
        assert scales == [0.0, 0.5, 0.0]  # the adapters left out are off
        text = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
        assert text == reference["second"]
    finally:
        httpx.post(url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}])


def _generate(url: str, extra: dict[str, Any]) -> tuple[list[int], int, int]:
    """A greedy /completion's tokens, how many of its prompt's were reused, and how many could
    have been."""
    body = {"prompt": PROMPT, "n_predict": 10, "temperature": 0.0, "return_tokens": True}
    answer = httpx.post(url + "/completion", json={**body, **extra}, timeout=60).json()
    return answer["tokens"], answer["timings"]["cache_n"], answer["tokens_evaluated"] - 1


def _erase_all(url: str) -> None:
    for slot in httpx.get(url + "/slots").json():
        assert httpx.post(url + f"/slots/{slot['id']}?action=erase").status_code == 200


def _saved(url: str, name: str, extra: dict[str, Any]) -> list[int]:
    """Generate with ``extra`` and save the slot that did as ``name``; the tokens."""
    _erase_all(url)
    tokens = _generate(url, extra)[0]
    (holder,) = [s["id"] for s in httpx.get(url + "/slots").json() if s["n_prompt_tokens"]]
    answer = httpx.post(url + f"/slots/{holder}?action=save", json={"filename": name})
    assert answer.status_code == 200, answer.text
    return tokens


def _restore(url: str, name: str, slot: int = 0) -> httpx.Response:
    return httpx.post(url + f"/slots/{slot}?action=restore", json={"filename": name})


def test_a_restored_slot_is_reused_only_with_the_adapters_it_was_computed_with(
    tiny_model_path: Path, files: dict[str, Path], tmp_path: Path
) -> None:
    # A slot file recorded nothing of its adapters: one request's KV without the adapter,
    # saved and restored, answered the next request with the default set (the adapter on).
    settings = ServerSettings(model=str(tiny_model_path), n_ctx=2 * 256, n_threads=2, parallel=2,
                              lora=(str(files["lora"]),), slot_save_path=str(tmp_path))  # fmt: skip
    off = {"lora": [{"id": 0, "scale": 0.0}]}

    def restored(url: str, name: str, extra: dict[str, Any]) -> tuple[list[int], int, int]:
        _erase_all(url)
        answer = _restore(url, name)
        assert answer.status_code == 200, answer.text
        return _generate(url, extra)

    for server in _running(settings):
        url = server.url
        adapted, without = _saved(url, "adapted", {}), _saved(url, "without", off)
        assert adapted != without
        tokens, cached, reusable = restored(url, "without", {})
        assert (tokens, cached) == (adapted, 0)  # decoded again, with the adapter
        assert restored(url, "without", off) == (without, reusable, reusable)
        assert restored(url, "adapted", {}) == (adapted, reusable, reusable)
        # Saved under the default set, restored after the defaults changed.
        assert httpx.post(url + "/lora-adapters", json=[{"id": 0, "scale": 0.5}]).is_success
        half = _saved(url, "half", {})
        assert restored(url, "adapted", {})[:2] == (half, 0)
        assert restored(url, "adapted", {"lora": [{"id": 0, "scale": 1.0}]})[1] == reusable
    # After a restart without the adapter: the KV of the base model is the one to reuse.
    plain = ServerSettings(model=str(tiny_model_path), n_ctx=2 * 256, n_threads=2, parallel=2,
                           slot_save_path=str(tmp_path))  # fmt: skip
    for server in _running(plain):
        assert restored(server.url, "without", {}) == (without, reusable, reusable)


def test_a_slot_state_no_request_here_can_reuse_is_refused_naming_why(
    tiny_model_path: Path, files: dict[str, Path], tmp_path: Path
) -> None:
    # Restored, such a state answered n_restored and was dropped by the next prompt.
    lora, copied = files["lora"], tmp_path / "copied.gguf"
    copied.write_bytes(lora.read_bytes())  # the same bytes elsewhere: another file
    base = {"model": str(tiny_model_path), "n_ctx": 2 * 256, "n_threads": 2, "parallel": 2,
            "slot_save_path": str(tmp_path)}  # fmt: skip
    for server in _running(ServerSettings(**base, lora=(str(lora),))):
        _saved(server.url, "adapted", {})
        _saved(server.url, "half", {"lora": [{"id": 0, "scale": 0.5}]})
        _saved(server.url, "none", {"lora": [{"id": 0, "scale": 0.0}]})
    others = {
        "LoRA adapter files (--lora": {"lora": (str(copied),)},
        "control vectors (--control-vector": {"lora_scaled": (f"{lora}:0",),
                                              "control_vectors": (str(files["cvec"]),)},
        "KV settings (--flash-attn": {"lora": (str(lora),), "rope_freq_scale": 0.5},
        # A KV stream per slot: llama.cpp loads a state into as many streams only.
        "--parallel: a KV stream per slot": {"lora": (str(lora),), "parallel": 1},
    }  # fmt: skip
    for named, flags in others.items():
        for server in _running(ServerSettings(**{**base, **flags})):
            url = server.url
            _erase_all(url)
            held, _, reusable = _generate(url, {})
            (holder,) = [s["id"] for s in httpx.get(url + "/slots").json() if s["n_prompt_tokens"]]
            answer = _restore(url, "adapted", holder)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["code"] == "slot_state_mismatch" and error["param"] == "filename"
            assert named in error["message"] and "'adapted'" in error["message"]
            assert _generate(url, {}) == (held, reusable, reusable)  # the slot as it was
            # Computed without adapters: reusable with other LoRA files, not the rest.
            assert _restore(url, "none").status_code == (200 if "LoRA" in named else 400)
    # A per-request scale is not a mismatch: a request may ask for it again.
    for server in _running(ServerSettings(**base, lora_scaled=(f"{lora}:0.25",))):
        _erase_all(server.url)
        assert _restore(server.url, "half").status_code == 200
        _, cached, reusable = _generate(server.url, {"lora": [{"id": 0, "scale": 0.5}]})
        assert cached == reusable > 0


def test_unmatchable_tells_lora_files_apart_from_scales(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    # What the restore check above relies on, with several adapters: a memory computed with
    # some of a context's LoRA files, at any scales, can be matched; one with another not.
    lora = [(str(files[name]), 0.0) for name in ("lora", "lora2", "alora")]
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, lora=lora) as llm:
        one, two, three = llm.adapters
        context = llm.context
        both = context.fingerprint({one: 0.3, two: -2.0, three: 0.0})
        assert context.unmatchable(both, [one, two, three]) == []
        assert context.unmatchable(both, [two, one]) == []
        assert context.unmatchable(both, [one, three]) == ["LoRA files"]
        assert context.unmatchable(both, []) == ["LoRA files"]
        assert context.unmatchable(context.fingerprint({}), []) == []
        assert context.unmatchable(context.fingerprint({three: 1.0}, 4), [three]) == []


def test_control_vector_layers_outside_the_model_fail_the_load_clearly(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    settings = ServerSettings(model=str(tiny_model_path), n_ctx=256, n_threads=2,
                              control_vectors=(str(files["cvec"]),),
                              control_vector_layer_range=(1, 9))  # fmt: skip
    for server in _running(settings):
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert "layer range 1..9 is outside this model's layers 1..2" in health.json()["error"]


def test_speculative_decoding_cache_and_control_vector_flags_serve(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    with Llama(tiny_model_path, n_ctx=256, n_threads=2,
               control_vectors=[str(files["cvec"])]) as llm:  # fmt: skip
        expected = llm.create_completion(PROMPT, **GREEDY).text
    for extra in ({"model_draft": str(files["draft"]), "draft_max": 4},
                  {"lookup_ngram": 2, "cache_ram": 16}):  # fmt: skip
        settings = ServerSettings(
            model=str(tiny_model_path),
            n_ctx=256,
            n_threads=2,
            control_vectors=(str(files["cvec"]),),
            **extra,
        )  # type: ignore[arg-type]
        for server in _running(settings):
            body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0}
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            # Drafts are verified with the same greedy rule: the same text (the tiny model
            # has no near-ties at temperature 0 on this prompt).
            assert answer.json()["choices"][0]["text"] == expected


def _stream_in_turn(
    index: int,
    client: openai.OpenAI,
    texts: dict[int, tuple[str, str | None]],
    first_chunk: threading.Event,
) -> None:
    """Stream a completion into ``texts[index]``; all but the first start once the first
    stream has sent a chunk."""
    if index:
        first_chunk.wait(30)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=120,
                                       temperature=0.0, stream=True)  # fmt: skip
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        first_chunk.set()
    texts[index] = ("".join(c.choices[0].text for c in chunks if c.choices),
                    chunks[-1].choices[0].finish_reason)  # fmt: skip


def test_one_slot_server_answers_concurrent_streams_in_turn(tiny_model_path: Path) -> None:
    """Speculative decoding runs one slot: a second stream waits for the first, never
    superseding it (which would end the first one early)."""
    settings = ServerSettings(model=str(tiny_model_path), n_ctx=512, n_threads=2,
                              lookup_ngram=2)  # fmt: skip
    for server in _running(settings):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        texts: dict[int, tuple[str, str | None]] = {}
        first_chunk = threading.Event()
        threads = [
            threading.Thread(target=_stream_in_turn, args=(i, client, texts, first_chunk))
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(texts) == 2 and texts[0] == texts[1]
        assert texts[0][1] == "length"
