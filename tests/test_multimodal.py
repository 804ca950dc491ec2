"""Images and audio through libmtmd, with generated tiny projectors (scripts/make_tiny_mmproj.py)
bound to the tiny text model: handles, inputs, errors, chat parts, parallel slots, the server."""

from __future__ import annotations

import base64
import io
import itertools
import json
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import httpx
import numpy as np
import openai
import pytest
from live_server import LiveServer
from PIL import Image as PILImage
from test_crash_proof import run_child
from test_tool_calls import TEMPLATE

from llamacrab import (
    Audio,
    ClosedHandleError,
    Completion,
    Image,
    InvalidParameterError,
    Llama,
    MediaError,
    MediaPolicy,
    ModelLoadError,
)
from llamacrab._field_types import LAST_POSITION
from llamacrab._native import mtmd as mtmd_handles
from llamacrab._native.call import call
from llamacrab._native.context import Context, ContextParams
from llamacrab._native.media import MAX_AUDIO_SECONDS
from llamacrab._native.model import Model
from llamacrab._native.mtmd import Projector, chunk_pointers, embeddings_refusal
from llamacrab.server import ServerSettings
from llamacrab.server._llama_kwargs import llama_kwargs
from llamacrab.server._settings import parse_settings
from llamacrab_sys import ffi, lib

from reliability_kit import tampered
from support import assert_same_up_to_near_ties, load_repo_module, wav_bytes

tiny = load_repo_module("scripts/make_tiny_gguf.py")
mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
PIXELS = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
IMAGE_TOKENS = (mmproj.VISION["image"] // mmproj.VISION["patch"]) ** 2
GREEDY = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("mtmd")
    return {
        "text": tiny.write_tiny_llama(out / "text.gguf", chat_templates={"": TEMPLATE}),
        "vision": mmproj.write_tiny_vision_mmproj(out / "vision.gguf"),
        "gemma3": mmproj.write_tiny_gemma3_mmproj(out / "gemma3.gguf"),
        "audio": mmproj.write_tiny_audio_mmproj(out / "audio.gguf"),
        "wrong": mmproj.write_tiny_vision_mmproj(out / "wrong.gguf", n_embd_text=32),
        # 16 embeddings from 4,096 patches: an encode of about a second on one thread
        "slow": mmproj.write_tiny_gemma3_mmproj(
            out / "slow.gguf", merge=16, vision=mmproj.SLOW_VISION
        ),
    }


@pytest.fixture(scope="module")
def seeing(files: dict[str, Path]) -> Iterator[Llama]:
    with Llama(files["text"], n_ctx=512, n_threads=2, mmproj=files["vision"]) as llm:
        yield llm


@pytest.fixture(scope="module")
def hearing(files: dict[str, Path]) -> Iterator[Llama]:
    with Llama(files["text"], n_ctx=2048, n_threads=2, mmproj=files["audio"]) as llm:
        yield llm


def encoded(pixels: np.ndarray, kind: str) -> bytes:
    buffer = io.BytesIO()
    PILImage.fromarray(pixels).save(buffer, format=kind)
    return buffer.getvalue()


def tone(rate: int, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_the_projector_describes_itself_and_follows_its_model(files: dict[str, Path]) -> None:
    llm = Llama(files["text"], n_ctx=256, mmproj=files["vision"])
    projector = llm.projector
    assert projector is not None and projector.vision and not projector.audio
    assert projector.sample_rate is None and llm.media_marker == "<__media__>"
    llm.close()
    assert projector.closed
    with pytest.raises(ClosedHandleError):
        projector.bitmap(Image(pixels=PIXELS))
    with (
        Llama(files["text"], n_ctx=256) as plain,
        pytest.raises(InvalidParameterError, match="takes no images or sounds"),
    ):
        plain.create_completion("x <__media__>", media=[Image(pixels=PIXELS)])


def test_an_image_takes_its_embeddings_in_the_prompt(seeing: Llama) -> None:
    text = f"the cat {seeing.media_marker} sat"
    chunks = seeing.tokenize_media(text, [Image(pixels=PIXELS)])
    assert chunks.media_tokens().tolist() == [0, IMAGE_TOKENS, 0]  # text, image, text
    text_tokens = len(seeing.tokenize("the cat ")) + len(seeing.tokenize(" sat", False))
    assert chunks.n_tokens == chunks.n_pos == text_tokens + IMAGE_TOKENS
    result = seeing.create_completion(chunks, **GREEDY)
    assert result.usage.prompt_tokens == chunks.n_pos and result.usage.completion_tokens == 6
    again = seeing.create_completion(text, media=[Image(pixels=PIXELS)], **GREEDY)
    assert again.choices[0].tokens == result.choices[0].tokens
    two = seeing.tokenize_media(f"{seeing.media_marker} and {seeing.media_marker}.",
                                [Image(pixels=PIXELS)] * 2)  # fmt: skip
    assert two.media_tokens().tolist().count(IMAGE_TOKENS) == 2


def test_pixels_and_lossless_files_give_the_same_answer(seeing: Llama, tmp_path: Path) -> None:
    text = f"look {seeing.media_marker} now"

    def answer(image: Image) -> tuple[int, ...]:
        return seeing.create_completion(text, media=[image], **GREEDY).choices[0].tokens

    by_pixels = answer(Image(pixels=PIXELS))
    png = tmp_path / "image.png"
    png.write_bytes(encoded(PIXELS, "PNG"))
    for image in (Image(data=encoded(PIXELS, "PNG")), Image(data=encoded(PIXELS, "BMP")),
                  Image.from_file(png)):  # fmt: skip
        assert answer(image) == by_pixels
    assert answer(Image(pixels=np.flipud(PIXELS).copy())) != by_pixels  # the image matters
    jpeg = Image(data=encoded(PIXELS, "JPEG"))  # lossy: it only has to work
    assert seeing.create_completion(text, media=[jpeg], **GREEDY).usage.completion_tokens == 6
    grey = Image(pixels=PIXELS[:, :, 0])
    assert seeing.create_completion(text, media=[grey], **GREEDY).usage.completion_tokens == 6


def test_audio_from_wav_bytes_and_samples_resampled(hearing: Llama) -> None:
    projector = hearing.projector
    assert projector is not None and projector.audio and projector.sample_rate == 16000
    text = f"hear {hearing.media_marker} now"
    by_samples = hearing.create_completion(
        text, media=[Audio(samples=tone(16000), sample_rate=16000)], **GREEDY
    )
    by_wav = hearing.create_completion(text, media=[Audio(data=wav_bytes(tone(16000), 16000))],
                                       **GREEDY)  # fmt: skip
    assert by_samples.usage.prompt_tokens == by_wav.usage.prompt_tokens > 750
    stereo = np.stack([tone(8000), tone(8000)], axis=1)
    resampled = hearing.create_completion(text, media=[Audio(samples=stereo, sample_rate=8000)],
                                          **GREEDY)  # fmt: skip
    assert resampled.usage.prompt_tokens == by_samples.usage.prompt_tokens
    # By content: the PCM libmtmd receives is the 16 kHz tone whichever way it came (a WAV it
    # decodes, float samples, or stereo at 8 kHz resampled here), and a different sound is not.
    reference = pcm(hearing, Audio(samples=tone(16000), sample_rate=16000))
    assert np.array_equal(reference, tone(16000))
    from_wav = pcm(hearing, Audio(data=wav_bytes(tone(16000), 16000)))
    from_stereo = pcm(hearing, Audio(samples=stereo, sample_rate=8000))
    assert len(from_wav) == len(from_stereo) == len(reference)
    assert np.abs(from_wav - reference).max() < 1e-3  # 16-bit quantization
    # Linear interpolation of 440 Hz at 8 kHz (the last sample is held, not interpolated).
    assert np.abs(from_stereo - reference)[:-1].max() < 0.02
    other = pcm(hearing, Audio(samples=tone(16000) * 0.5, sample_rate=16000))
    assert np.abs(other - reference).max() > 0.2


def test_a_short_file_declaring_hours_of_sound_is_refused_before_decoding(
    hearing: Llama,
) -> None:
    # 100 kB of 8-bit samples at a declared 1 Hz: 28 hours, 6.4 GB of float samples at
    # 16 kHz, which unpatched libmtmd allocates and fills first (42 s here before bad_alloc).
    fmt = struct.pack("<HHIIHH", 1, 1, 1, 1, 1, 8)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data"
    body += struct.pack("<I", 100_000) + bytes(100_000)
    bomb = b"RIFF" + struct.pack("<I", len(body)) + body
    started = time.perf_counter()
    with pytest.raises(MediaError, match=r"1600000000 samples at 16000 Hz; the limit is 3600 s"):
        hearing.create_completion(f"{hearing.media_marker}.", media=[Audio(data=bomb)], **GREEDY)
    assert time.perf_counter() - started < 5
    valid = wav_bytes(np.zeros(10, np.float32), 16000)  # and the Llama goes on
    assert hearing.create_completion(f"{hearing.media_marker}.", media=[Audio(data=valid)],
                                     **GREEDY).usage.completion_tokens == 6  # fmt: skip


FORMAT_CHUNK_CHILD = """
    import pathlib, sys
    from llamacrab import Audio, Llama, MediaError
    from llamacrab._native import mtmd
    if sys.argv[4] == "unchecked":
        mtmd.check_wav_format_chunks = lambda data: None
    sound = Audio(data=pathlib.Path(sys.argv[3]).read_bytes())
    with Llama(sys.argv[1], n_ctx=2048, n_threads=1, mmproj=sys.argv[2]) as llm:
        prompt = f"{llm.media_marker}."
        try:
            llm.create_completion(prompt, media=[sound], max_tokens=1)
            print("decoded")
        except MediaError as error:
            print("refused:", error)
        print(llm.create_completion("the cat", max_tokens=2, temperature=0).usage)
"""


def wav_with_format_chunk_size(size: int) -> bytes:
    """A WAV whose format chunk (16 bytes) claims ``size``: dr_wav then reads the first two
    bytes of the data chunk's id ("da", 24,932) as the length of an extension. Its RIFF size
    says 3 bytes, as the file the media section found (with the true size dr_wav gives up)."""
    data = bytearray(wav_bytes(tone(16000)[:400], 16000))
    assert data[12:20] == b"fmt " + struct.pack("<I", 16)
    data[4:8], data[16:20] = struct.pack("<I", 3), struct.pack("<I", size)
    return bytes(data)


@pytest.mark.parametrize(
    "size",
    [21_776, 2**31 + 18 + 24_932],  # left after the extension: -3,174 bytes; 2 GiB, an int's -2 GiB
    ids=["shorter-than-its-extension", "past-2-GiB"],
)
def test_a_wav_format_chunk_that_would_seek_backwards_is_refused(
    files: dict[str, Path], tmp_path: Path, size: int
) -> None:
    # miniaudio's dr_wav (libmtmd's decoder) seeks by (int)(size - 18 - extension) past the
    # chunk: negative here, so it reads the chunks before again, for ever (the media section,
    # seed 2035: an 844-byte file held the process past its 60 s limit).
    sound = tmp_path / "sound.wav"
    sound.write_bytes(wav_with_format_chunk_size(size))
    args = (str(files["text"]), str(files["audio"]), str(sound))
    checked = run_child(FORMAT_CHUNK_CHILD, *args, "checked", timeout=60)
    assert checked.returncode == 0, checked.stderr[-3000:]
    refusal = f"refused: the WAV file's format chunk is {size} bytes long but holds a 24932-byte"
    assert refusal in checked.stdout and "completion_tokens=2" in checked.stdout, checked.stdout
    with pytest.raises(subprocess.TimeoutExpired):  # what the check keeps from libmtmd
        run_child(FORMAT_CHUNK_CHILD, *args, "unchecked", timeout=8)


def test_a_wav_format_chunk_with_an_empty_extension_decodes(hearing: Llama) -> None:
    # 18 bytes with a zero extension size, as many writers make WAVE_FORMAT_PCM: nothing left.
    fmt = struct.pack("<HHIIHHH", 1, 1, 16000, 32000, 2, 16, 0)
    samples = (tone(16000)[:4000] * 32767).astype("<i2").tobytes()
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data"
    body += struct.pack("<I", len(samples)) + samples
    sound = Audio(data=b"RIFF" + struct.pack("<I", len(body)) + body)
    assert len(pcm(hearing, sound)) == 4000


def pcm(llm: Llama, sound: Audio) -> np.ndarray:
    """The float samples of the bitmap a sound becomes for libmtmd."""
    assert llm.projector is not None
    bitmap = llm.projector.bitmap(sound)
    try:
        size = lib.mtmd_bitmap_get_n_bytes(bitmap.pointer)
        data = ffi.buffer(lib.mtmd_bitmap_get_data(bitmap.pointer), size)
        return np.frombuffer(data, dtype=np.float32).copy()
    finally:
        bitmap.close()


def test_bad_media_raise_clear_errors_and_nothing_breaks(
    seeing: Llama, hearing: Llama, files: dict[str, Path]
) -> None:
    image, sound = Image(pixels=PIXELS), Audio(samples=tone(16000), sample_rate=16000)
    marker = seeing.media_marker
    cases = [
        (seeing, f"{marker}.", [sound], "no audio encoder"),
        (hearing, f"{marker}.", [image], "no image encoder"),
        (seeing, f"{marker}.", [Image(data=b"not an image at all")], "unrecognized media format"),
        (seeing, f"{marker}.", [Image(data=encoded(PIXELS, "PNG")[:60])], "could not decode"),
        (hearing, f"{marker}.", [Audio(data=b"RIFF\0\0\0\0WAVEjunkjunk")], "could not decode"),
        (seeing, f"{marker}.", [Image(data=wav_bytes(tone(16000), 16000))], "hold audio"),
        (seeing, f"{marker} {marker}", [image], "2 media markers"),
        (seeing, "no marker", [image], "0 media markers"),
        (seeing, marker * 9, [image] * 9, "more than 8"),
        (seeing, f"{marker}.", [Image(pixels=PIXELS.astype(np.float32))], "uint8"),
        (seeing, f"{marker}.", [Image(pixels=PIXELS[:, :, :2])], "RGB"),
        (hearing, f"{marker}.", [Audio(samples=np.zeros(1, np.float32), sample_rate=16000)],
         "at least 2"),
        (hearing, f"{marker}.", [Audio(data=wav_bytes(np.zeros(1, np.float32), 16000))],
         "fewer than 2"),
    ]  # fmt: skip
    for llm, text, media, words in cases:
        with pytest.raises(MediaError, match=words):
            llm.create_completion(text, media=media, **GREEDY)
    with pytest.raises(MediaError, match="sample_rate"):
        Audio(samples=tone(16000))
    # Found by a hunt: TypeError or ValueError from deep inside, or accepted ("at True Hz").
    for rate in ("16000", float("nan"), True, -1):
        with pytest.raises(MediaError, match=f"sample_rate in Hz, not {rate!r}"):
            Audio(samples=tone(16000), sample_rate=rate)  # type: ignore[arg-type]
    for data in ("a.png", memoryview(b"x"), 5, [1, 2]):
        with pytest.raises(MediaError, match="data must be a file's bytes, not"):
            Image(data=data)  # type: ignore[arg-type]
    with pytest.raises(MediaError, match="either data"):
        Image()
    with pytest.raises(ModelLoadError, match="mismatch between text model"):
        Llama(files["text"], n_ctx=256, mmproj=files["wrong"])
    with pytest.raises(MediaError, match="end the prompt with text"):
        seeing.create_completion(f"look {marker}", media=[image], **GREEDY)
    assert (
        seeing.create_completion(f"{marker}.", media=[image], **GREEDY).usage.completion_tokens == 6
    )
    assert seeing.create_completion("plain text", **GREEDY).usage.completion_tokens == 6


def test_chat_parts_carry_images_and_audio(seeing: Llama, hearing: Llama, tmp_path: Path) -> None:
    png = encoded(PIXELS, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    (tmp_path / "cat.png").write_bytes(png)
    for url in (data_url, str(tmp_path / "cat.png"), (tmp_path / "cat.png").as_uri()):
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]  # fmt: skip
        result = seeing.create_chat_completion(messages, **GREEDY)
        assert result.usage.prompt_tokens > IMAGE_TOKENS
    audio_part = {
        "type": "input_audio",
        "input_audio": {
            "data": base64.b64encode(wav_bytes(tone(16000), 16000)).decode(),
            "format": "wav",
        },
    }
    heard = hearing.create_chat_completion([{"role": "user", "content": [audio_part]}], **GREEDY)
    assert heard.usage.prompt_tokens > 750
    remote = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]  # fmt: skip
    with pytest.raises(MediaError, match="remote media URLs are disabled"):
        seeing.create_chat_completion(remote, **GREEDY)


def test_a_policy_without_local_files_refuses_paths(files: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(encoded(PIXELS, "PNG"))
    policy = MediaPolicy(local_files=False)
    with Llama(files["text"], n_ctx=256, mmproj=files["vision"], media_policy=policy) as llm:
        part = {"type": "image_url", "image_url": {"url": str(tmp_path / "cat.png")}}
        with pytest.raises(MediaError, match="local media files are not allowed"):
            llm.create_chat_completion([{"role": "user", "content": [part]}], **GREEDY)


def test_parallel_slots_take_media_too(files: dict[str, Path], seeing: Llama) -> None:
    prompts = [f"picture {i} {seeing.media_marker} now" for i in range(4)]
    images = [Image(pixels=np.roll(PIXELS, i, axis=0)) for i in range(4)]
    pairs = list(zip(prompts, images, strict=True))
    options = {**GREEDY, "logprobs": 2}
    alone = [seeing.create_completion(p, media=[m], **options) for p, m in pairs]
    with Llama(files["text"], n_ctx=4 * 512, n_threads=2, parallel=4,
               mmproj=files["vision"]) as llm, ThreadPoolExecutor(4) as pool:  # fmt: skip
        together = list(pool.map(
            lambda pm: llm.create_completion(pm[0], media=[pm[1]], **options), pairs
        ))  # fmt: skip
    assert [r.usage.prompt_tokens for r in together] == [r.usage.prompt_tokens for r in alone]
    assert all(r.usage.completion_tokens == 6 for r in together)

    def logprobs(result: Completion) -> np.ndarray:
        assert result.choices[0].logprobs is not None
        return np.array(result.choices[0].logprobs.token_logprobs)

    # The tiny model's greedy text is the same whatever it sees, but the log-probabilities of
    # that text tell each image apart (by > 0.01); each slot's match its own image's lone run.
    for a, b in itertools.combinations(alone, 2):
        assert np.abs(logprobs(a) - logprobs(b)).max() > 0.01
    for lone, batched in zip(alone, together, strict=True):
        assert_same_up_to_near_ties(lone.choices[0], batched.choices[0])
        assert np.abs(logprobs(lone) - logprobs(batched)).max() < 2e-3


def test_the_server_takes_inline_images_and_refuses_paths(
    files: dict[str, Path], tmp_path: Path
) -> None:
    settings = ServerSettings(model=str(files["text"]), mmproj=str(files["vision"]), n_ctx=1024,
                              max_media=2)  # fmt: skip
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        data_url = "data:image/png;base64," + base64.b64encode(encoded(PIXELS, "PNG")).decode()
        image = {"type": "image_url", "image_url": {"url": data_url}}
        result = client.chat.completions.create(
            model="text.gguf", max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, image]}],  # type: ignore[list-item]
        )  # fmt: skip
        assert result.usage is not None and result.usage.prompt_tokens > IMAGE_TOKENS
        (tmp_path / "secret.png").write_bytes(encoded(PIXELS, "PNG"))
        for content, words in [
            ([{"type": "image_url", "image_url": {"url": str(tmp_path / "secret.png")}}],
             "local media files are not allowed"),
            ([image] * 3, "more than 2"),
            ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}],
             "base64"),
        ]:  # fmt: skip
            answer = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 2})  # fmt: skip
            assert answer.status_code == 400, answer.text
            assert words in json.loads(answer.text)["error"]["message"]
    finally:
        server.close()


NON_CAUSAL_CHILD = """
    import sys
    import numpy as np
    from llamacrab import Image, InvalidParameterError, Llama
    from llamacrab._native import mtmd
    if sys.argv[3] == "unchecked":
        mtmd._check_micro_batch = lambda *args: None
    image = Image(pixels=np.zeros((32, 32, 3), np.uint8))
    with Llama(sys.argv[1], n_ctx=256, n_threads=1, n_ubatch=8, mmproj=sys.argv[2]) as llm:
        try:
            llm.create_completion(f"look {llm.media_marker} now", media=[image], max_tokens=1)
            print("decoded")
        except InvalidParameterError as error:
            print("refused:", error)
"""


def test_a_non_causal_image_larger_than_n_ubatch_is_refused_not_an_abort(
    files: dict[str, Path],
) -> None:
    # Gemma 3 images attend both ways: llama_decode asserts n_ubatch >= their token count.
    checked = run_child(NON_CAUSAL_CHILD, str(files["text"]), str(files["gemma3"]), "checked")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert f"into {IMAGE_TOKENS} tokens" in checked.stdout
    assert "n_ubatch is 8" in checked.stdout and f"n_ubatch={IMAGE_TOKENS}" in checked.stdout
    unchecked = run_child(NON_CAUSAL_CHILD, str(files["text"]), str(files["gemma3"]), "unchecked")
    assert unchecked.returncode == -signal.SIGABRT, (
        f"llama.cpp no longer aborts (exit {unchecked.returncode}): re-audit "
        f"docs/native-aborts.md\n{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )
    assert "non-causal attention requires n_ubatch" in unchecked.stderr


def test_an_image_that_fits_n_ubatch_decodes_whatever_the_projector(
    files: dict[str, Path],
) -> None:
    for projector, n_ubatch in (("gemma3", IMAGE_TOKENS), ("vision", 8)):  # LLaVA: causal
        with Llama(files["text"], n_ctx=256, n_threads=2, n_ubatch=n_ubatch,
                   mmproj=files[projector]) as llm:  # fmt: skip
            text = f"look {llm.media_marker} now"
            result = llm.create_completion(text, media=[Image(pixels=PIXELS)], **GREEDY)
        assert result.usage.completion_tokens == 6


# -- text models whose graph aborts on embeddings ---------------------------------------------


def write_tiny_glm4(path: Path, sections: list[int] | None) -> Path:
    """The tiny llama as a glm4 text model (fused ffn_up, post norms), with M-RoPE
    ``rope.dimension_sections`` or none."""
    writer = gguf.GGUFWriter(str(path), "glm4")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    if sections is not None:
        writer.add_array("glm4.rope.dimension_sections", sections)
    tensors = tiny._tensors(0, len(tiny.vocabulary()[0]))
    rng = np.random.default_rng(1)
    for i in range(tiny.N_LAYER):
        del tensors[f"blk.{i}.ffn_gate.weight"]
        up = rng.standard_normal((2 * tiny.N_FF, tiny.N_EMBD)) * 0.02
        tensors[f"blk.{i}.ffn_up.weight"] = up.astype(np.float32)
        for norm in ("post_attention_norm", "post_ffw_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = np.ones(tiny.N_EMBD, np.float32)
    tiny.write_gguf(writer, tensors)
    return path


def test_a_glm4_without_mrope_refuses_a_projector(files: dict[str, Path], tmp_path: Path) -> None:
    # glm4.cpp / glm4-moe.cpp abort ("does not support multimodal") on embeddings without M-RoPE.
    plain = write_tiny_glm4(tmp_path / "glm4.gguf", None)
    with pytest.raises(MediaError, match=r"glm4 file has no M-RoPE"):
        Llama(plain, n_ctx=256, n_threads=1, mmproj=files["vision"])
    with Llama(plain, n_ctx=256, n_threads=1) as llm:  # still a working text model
        assert llm.create_completion("the cat", **GREEDY).usage.completion_tokens == 6
    mrope = write_tiny_glm4(tmp_path / "glm4v.gguf", [4, 4, 0, 0])
    with Llama(mrope, n_ctx=256, n_threads=1, mmproj=files["vision"]) as llm:
        assert llm.projector is not None


def test_archs_whose_graph_aborts_on_embeddings_are_refused() -> None:
    mrope, norm, neox = (lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_NORM,
                         lib.LLAMA_ROPE_TYPE_NEOX)  # fmt: skip
    assert "token ids only" in (embeddings_refusal("graniteswitch", norm) or "")
    assert "token ids only" in (embeddings_refusal("graniteswitch", mrope) or "")
    assert "glm4moe file has no M-RoPE" in (embeddings_refusal("glm4moe", neox) or "")
    assert embeddings_refusal("glm4moe", mrope) is None
    assert embeddings_refusal("glm4", mrope) is None
    assert embeddings_refusal("llama", norm) is None


GLM4_CHILD = """
    import sys
    import numpy as np
    from llamacrab import Image, Llama, MediaError
    from llamacrab._native import mtmd
    if sys.argv[3] == "unchecked":
        mtmd.embeddings_refusal = lambda *args: None
    image = Image(pixels=np.zeros((32, 32, 3), np.uint8))
    try:
        with Llama(sys.argv[1], n_ctx=256, n_threads=1, mmproj=sys.argv[2]) as llm:
            llm.create_completion(f"look {llm.media_marker} now", media=[image], max_tokens=1)
            print("decoded")
    except MediaError as error:
        print("refused:", error)
"""


def test_the_glm4_refusal_turns_an_abort_into_an_error(
    files: dict[str, Path], tmp_path: Path
) -> None:
    model = str(write_tiny_glm4(tmp_path / "glm4.gguf", None))
    checked = run_child(GLM4_CHILD, model, str(files["vision"]), "checked")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout.startswith("refused:") and "M-RoPE" in checked.stdout, checked.stdout
    unchecked = run_child(GLM4_CHILD, model, str(files["vision"]), "unchecked")
    assert unchecked.returncode == -signal.SIGABRT, (
        f"llama.cpp no longer aborts (exit {unchecked.returncode}): re-audit "
        f"docs/native-aborts.md\n{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )
    assert "does not support multimodal" in unchecked.stderr


# -- projector files that disagree with themselves -------------------------------------------


def projector_variant(original: Path, out: Path, change: Callable[[tampered.Header], None]) -> Path:
    """``original`` with its header changed by ``change`` (the tensor data kept as it is)."""
    header = tampered.parse(original)
    change(header)
    encoded = header.encode()
    data = original.read_bytes()[header.data_offset :]
    out.write_bytes(encoded + bytes(-len(encoded) % header.alignment) + data)
    return out


def renamed_first_tensor(header: tampered.Header) -> None:
    name, dims, ttype, offset = header.tensors[0]
    header.tensors[0] = (b"v.unused." + name, dims, ttype, offset)


def with_u32(key: bytes, value: int) -> Callable[[tampered.Header], None]:
    def change(header: tampered.Header) -> None:
        header.kvs = [(k, t, struct.pack("<I", value) if k == key else v)
                      for k, t, v in header.kvs]  # fmt: skip

    return change


def as_float(key: bytes) -> Callable[[tampered.Header], None]:
    def change(header: tampered.Header) -> None:
        header.kvs = [(k, tampered.F32, struct.pack("<f", 4.0)) if k == key else (k, t, v)
                      for k, t, v in header.kvs]  # fmt: skip

    return change


PROBE_CHILD = """
    import sys
    import numpy as np
    from llamacrab import Audio, Image, Llama, ModelLoadError
    try:
        llm = Llama(sys.argv[1], n_ctx=1024, n_threads=1, mmproj=sys.argv[2],
                    mmproj_probe=sys.argv[3] == "probe")
    except ModelLoadError as error:
        print("refused:", error)
    else:
        media = (Image(pixels=np.full((20, 30, 3), 90, np.uint8)) if llm.projector.vision
                 else Audio(samples=np.zeros(8000, np.float32), sample_rate=16000))
        llm.create_completion(f"{llm.media_marker} .", media=[media], max_tokens=1)
        print("answered")
"""


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (renamed_first_tensor, "SIGSEGV"),  # building the graph at load
        (with_u32(b"clip.vision.attention.head_count", 5), "GGML_ASSERT"),
        # More patches than position embeddings: fails at the first encode, not at load.
        (with_u32(b"clip.vision.image_size", 64), "GGML_ASSERT(i01 >= 0 && i01 < ne01)"),
    ],
    ids=["a tensor missing", "a head count that does not divide the width", "an image size"],
)
def test_a_projector_that_kills_its_trial_load_is_refused(
    files: dict[str, Path], tmp_path: Path, change: Callable[[tampered.Header], None],
    reason: str,
) -> None:  # fmt: skip
    bad = projector_variant(files["vision"], tmp_path / "bad.gguf", change)
    checked = run_child(PROBE_CHILD, str(files["text"]), str(bad), "probe")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout.startswith("refused:") and "killed a" in checked.stdout
    assert reason in checked.stdout, checked.stdout
    # Without the trial load the same file kills the process (what the probe is for).
    unchecked = run_child(PROBE_CHILD, str(files["text"]), str(bad), "trust")
    assert unchecked.returncode < 0, (unchecked.returncode, unchecked.stdout)
    # A sound projector passes its trial and works (the test files' own, made valid).
    good = run_child(PROBE_CHILD, str(files["text"]), str(files["audio"]), "probe")
    assert good.stdout.strip() == "answered", good.stdout + good.stderr[-2000:]


def test_a_projector_key_of_another_type_is_a_load_error(
    files: dict[str, Path], tmp_path: Path
) -> None:
    # libmtmd reads it with gguf_get_val_u32, which asserted the type (an abort) before the
    # clip-metadata-types patch; it throws now, and the load fails cleanly.
    bad = projector_variant(files["vision"], tmp_path / "typed.gguf",
                            as_float(b"clip.vision.block_count"))  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"clip.vision.block_count is a f32, not a u32"):
        Llama(files["text"], n_ctx=256, n_threads=1, mmproj=bad, mmproj_probe=False)


def test_a_probe_that_cannot_start_says_how_to_do_without(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(ModelLoadError, match=r"could not start a child.*mmproj_probe=False"):
        Llama(files["text"], n_ctx=256, n_threads=1, mmproj=files["vision"])
    with Llama(files["text"], n_ctx=256, n_threads=1, mmproj=files["vision"],
               mmproj_probe=False) as llm:  # fmt: skip
        assert llm.projector is not None and llm.projector.vision


@pytest.mark.parametrize("status", [2, 3])
def test_a_trial_ending_in_any_other_status_than_its_own_is_a_death(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, status: int
) -> None:
    # Windows has no signals: a child's abort() ends it with status 3, an access violation with
    # 0xC0000005. Only the trial's own 0 and 1 mean it lived; this child "dies" with `status`.
    dying = tmp_path / "dying-python"
    dying.write_text(f"#!/bin/sh\nexit {status}\n")
    dying.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(dying))
    with pytest.raises(ModelLoadError, match=rf"killed a child.*\(exited with {status}: "):
        Llama(files["text"], n_ctx=256, n_threads=1, mmproj=files["vision"])


def test_the_server_probes_its_projector_unless_told_not_to(files: dict[str, Path]) -> None:
    shown = {"model": str(files["text"]), "mmproj": str(files["vision"])}
    assert llama_kwargs(ServerSettings(**shown))["mmproj_probe"] is True
    trusting = parse_settings([shown["model"], "--mmproj", shown["mmproj"],
                               "--no-mmproj-probe"], {})  # fmt: skip
    assert trusting.no_mmproj_probe
    assert llama_kwargs(trusting)["mmproj_probe"] is False


# Closes the model while another thread tokenizes a long multimodal prompt, at several delays.
_CLOSE_WHILE_TOKENIZING = """
import sys, threading, time
import numpy as np
from llamacrab import ClosedHandleError, Image, Llama
text, vision, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
llm = Llama(text, n_ctx=512, n_threads=1, mmproj=vision, mmproj_probe=False)
projector = llm.projector
bitmap = projector.bitmap(Image(pixels=np.full((8, 8, 3), 128, np.uint8)))
prompt = projector.marker + " the cat sat" * 200_000
outcome = []
def tokenize():
    try:
        while True:
            projector.tokenize(prompt, [bitmap]).close()
    except ClosedHandleError:
        outcome.append("closed")
worker = threading.Thread(target=tokenize)
worker.start()
time.sleep(delay)
llm.close()
worker.join(60)
print(outcome)
"""


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1, 0.3])
def test_closing_the_model_while_a_thread_tokenizes_media_waits_for_it(
    files: dict[str, Path], delay: float
) -> None:
    # Found by lifecycle fuzzing (a close during a completion with an image): mtmd_tokenize ran
    # on a projector, chunks and bitmaps it did not hold, and a close freed them under it
    # (SIGSEGV). The call now holds each in flight, so the close waits for it.
    child = subprocess.run(
        [sys.executable, "-c", _CLOSE_WHILE_TOKENIZING, str(files["text"]), str(files["vision"]),
         str(delay)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "['closed']"


# -- stopping an encode ------------------------------------------------------------------------

STOP_ENCODE_CHILD = """
import os, signal, sys, threading, time
import numpy as np
from llamacrab import Image, Llama, LlamaError
llm = Llama(sys.argv[1], n_ctx=512, n_threads=1, mmproj=sys.argv[2], parallel=eval(sys.argv[3]))
pixels = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
prompt = f"look {llm.media_marker} now"

def answer():
    return llm.create_completion(prompt, media=[Image(pixels=pixels)], max_tokens=4,
                                 temperature=0).choices[0]

started = time.perf_counter()
reference = answer().tokens
print("whole", time.perf_counter() - started)
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
started = time.perf_counter()
try:
    answer()
    print("interrupted", "never")
except KeyboardInterrupt:
    print("interrupted", time.perf_counter() - started - 0.2)
print("same", answer().tokens == reference)
threading.Timer(0.2, llm.cancel).start()
started = time.perf_counter()
finish = answer().finish_reason
print("cancelled", time.perf_counter() - started - 0.2, finish)
stream = llm.stream_completion(prompt, media=[Image(pixels=pixels)], max_tokens=4)
threading.Timer(0.2, stream.cancel).start()
started = time.perf_counter()
finish = list(stream)[-1].finish_reason
print("stream", time.perf_counter() - started - 0.2, finish)
outcome = []

def complete():
    try:
        outcome.append(answer().finish_reason)
    except LlamaError as error:
        outcome.append(type(error).__name__)

worker = threading.Thread(target=complete)
worker.start()
time.sleep(0.2)
started = time.perf_counter()
llm.close()
print("closed", time.perf_counter() - started)
worker.join(60)
print("worker", *outcome)
"""


@pytest.mark.parametrize("parallel", ["None", "2"])
def test_a_ctrl_c_a_cancel_or_a_close_stops_an_image_encode_in_the_middle(
    files: dict[str, Path], parallel: str
) -> None:
    # libmtmd encodes an image in one graph on its own backends, which polled no abort flag:
    # a Ctrl-C, a cancel() or a close() waited for the whole encode (seconds for a real
    # projector's large image on the CPU). A patch points the encoder at the context's abort
    # flags. With parallel slots the engine thread encodes: no Ctrl-C there (the main thread's).
    child = run_child(STOP_ENCODE_CHILD, str(files["text"]), str(files["slow"]), parallel)
    assert child.returncode == 0, child.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in child.stdout.splitlines())
    whole = float(lines["whole"])
    assert whole > 0.5, f"the slow projector encodes in {whole:.2f} s: too fast to interrupt"
    if parallel == "None":
        assert float(lines["interrupted"]) < whole / 4, child.stdout
    assert lines["same"] == "True"  # nothing of the interrupted prompt stays behind
    for how in ("cancelled", "stream"):  # Llama.cancel(), Stream.cancel()
        seconds, finish = lines[how].split()
        assert float(seconds) < whole / 4 and finish == "cancelled", child.stdout
    assert float(lines["closed"]) < whole / 4, child.stdout
    # ended as any completion the close cuts short: cancelled, or refused once closed
    assert lines["worker"] in ("cancelled", "ClosedHandleError"), child.stdout


def test_the_encoder_polls_the_abort_callback_it_is_given(seeing: Llama) -> None:
    projector = seeing.projector
    assert projector is not None
    bitmap = projector.bitmap(Image(pixels=PIXELS))
    with projector.tokenize(f"look {projector.marker} now", [bitmap]) as chunks:
        flags = ffi.new("llamacrab_abort_flags *")
        with projector.in_flight() as pointer, chunks.in_flight() as chunk_list:
            kinds = [int(lib.mtmd_input_chunk_get_type(c)) for c in chunk_pointers(chunk_list)]
            image = chunk_pointers(chunk_list)[kinds.index(lib.MTMD_INPUT_CHUNK_TYPE_IMAGE)]
            call("mtmd_set_abort_callback", pointer, lib.llamacrab_abort_on_flags, flags)
            try:
                flags.cancel = 1
                stopped = call("mtmd_encode_chunk", pointer, image)
                flags.cancel = 0
                encoded = call("mtmd_encode_chunk", pointer, image)
            finally:
                call("mtmd_set_abort_callback", pointer, ffi.NULL, ffi.NULL)
    assert (stopped, encoded) == (1, 0)
    # evaluate() sets the callback for its own call only and takes it off afterwards
    assert seeing.create_completion(f"look {projector.marker} now", media=[Image(pixels=PIXELS)],
                                    **GREEDY).usage.completion_tokens == 6  # fmt: skip


def test_a_libmtmd_without_the_abort_callback_still_evaluates(
    seeing: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An install a user brings has upstream's libmtmd: its encodes run to their end.
    prompt, image = f"look {seeing.media_marker} now", [Image(pixels=PIXELS)]
    reference = seeing.create_completion(prompt, media=image, **GREEDY).choices[0].tokens
    monkeypatch.setattr(mtmd_handles, "_ENCODER_ABORTS", False)
    assert seeing.create_completion(prompt, media=image, **GREEDY).choices[0].tokens == reference


SHARED_PROJECTOR_CHILD = """
import sys, threading, time
import numpy as np
from llamacrab import ConcurrentUseError, Context, ContextParams, Image, Model, Projector
model = Model.load(sys.argv[1])
projector = Projector(model, sys.argv[2], n_threads=1)
pixels = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
first, second = (Context(model, ContextParams(n_ctx=512)) for _ in range(2))

def evaluate(context):
    bitmap = projector.bitmap(Image(pixels=pixels))
    with projector.tokenize(f"look {projector.marker} now", [bitmap]) as chunks:
        return projector.evaluate(context, chunks, 0, 0)

results = []
worker = threading.Thread(target=lambda: results.append(evaluate(first)))
worker.start()
time.sleep(0.2)
try:
    print("second", evaluate(second))
except ConcurrentUseError as error:
    print("second refused:", error)
worker.join()
print("first", *results)
print("then", evaluate(second))
"""


def test_one_projector_evaluates_for_one_context_at_a_time(files: dict[str, Path]) -> None:
    # libmtmd keeps one compute graph and output buffer per projector: two contexts evaluating
    # through one Projector at once crashed the process (SIGSEGV).
    child = run_child(SHARED_PROJECTOR_CHILD, str(files["text"]), str(files["slow"]))
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert lines[0] == "second refused: this projector is evaluating a prompt on another thread"
    assert lines[1] == lines[2].replace("then", "first"), lines


FOREIGN_MEDIA_CHILD = """
import sys
import numpy as np
from llamacrab import Context, ContextParams, Image, Llama, LlamaError, Model, Projector
text, vision, gemma3, other = sys.argv[1:]
image = Image(pixels=np.zeros((32, 32, 3), np.uint8))
with Llama(text, n_ctx=512, n_threads=1, mmproj=vision) as seeing:
    chunks = seeing.tokenize_media("look " + seeing.media_marker + " here", [image])
    for llm in (Llama(other, n_ctx=512, n_threads=1),  # wider, no projector
                Llama(text, n_ctx=512, n_threads=1, mmproj=gemma3)):  # another projector
        with llm:
            try:
                llm.create_completion(chunks, max_tokens=2)
            except LlamaError as error:
                print("refused:", error)
            print("then:", llm.create_completion("the cat", max_tokens=2).usage.completion_tokens)
    model, wide = seeing.model, Model.load(other)
    merged = Projector(model, gemma3)  # fewer embeddings per image than vision's
    own = Context(model, ContextParams(n_ctx=512, n_ubatch=512))
    for projector, context in ((merged, own), (chunks.projector, Context(wide))):
        try:
            projector.evaluate(context, chunks, 0, 0)
        except LlamaError as error:
            print("refused:", error)
    print("then:", chunks.projector.evaluate(own, chunks, 0, 0))
"""


def test_media_chunks_of_another_projector_or_model_are_refused_not_a_crash(
    files: dict[str, Path], gemma_path: Path
) -> None:
    # libmtmd sized the embeddings by one model and read them for another: SIGSEGV, or garbage
    # decoded; chunks of a projector with fewer tokens per image aborted in clip.
    args = (files["text"], files["vision"], files["gemma3"], gemma_path)
    child = run_child(FOREIGN_MEDIA_CHILD, *map(str, args), timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    refusals = [line for line in lines if line.startswith("refused:")]
    assert len(refusals) == 4, child.stdout
    assert "takes no images or sounds" in refusals[0]
    assert "another Llama's projector" in refusals[1]
    assert "another projector" in refusals[2] and "another model" in refusals[3]
    assert lines.count("then: 2") == 2, child.stdout  # both Llamas still generate
    assert int(lines[-1].removeprefix("then: ")) > IMAGE_TOKENS  # the chunks' own projector


EVALUATE_WHERE_CHILD = """
import sys
import numpy as np
from llamacrab import Context, ContextParams, Image, InvalidParameterError, Model, Projector
model = Model.load(sys.argv[1])
projector = Projector(model, sys.argv[2], n_threads=1)
context = Context(model, ContextParams(n_ctx=512, n_seq_max=2))
bitmap = projector.bitmap(Image(pixels=np.zeros((32, 32, 3), np.uint8)))
with projector.tokenize(f"look {projector.marker} now", [bitmap]) as chunks:
    for n_past, seq_id in ((0, 2), (0, -1), (-1, 0), (2**31 - 20, 0), (2**31, 0)):
        try:
            projector.evaluate(context, chunks, n_past, seq_id)
        except InvalidParameterError as error:
            print("refused:", error)
    print("then:", projector.evaluate(context, chunks, 0, 1), chunks.n_pos)
"""


def test_evaluate_refuses_a_sequence_or_position_the_context_cannot_take(
    files: dict[str, Path],
) -> None:
    # libmtmd's helper asserted on a sequence past n_seq_max (SIGABRT, mtmd-helper.cpp:231) and
    # placed the prompt at any n_past: -1 (a token the KV cache holds but counts as empty) or
    # past INT32_MAX (a signed overflow).
    child = run_child(EVALUATE_WHERE_CHILD, str(files["text"]), str(files["vision"]))
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert lines[:2] == [
        "refused: sequence 2 outside 0..1 (n_seq_max)",
        "refused: sequence -1 outside 0..1 (n_seq_max)",
    ]
    assert lines[2] == "refused: position -1 is negative: positions start at 0"
    assert f"leaves room for, {LAST_POSITION}" in lines[3]
    assert lines[4].startswith("refused: n_past must be an integer in")
    new_n_past, n_pos = (int(word) for word in lines[5].split()[1:])
    assert new_n_past == n_pos > IMAGE_TOKENS  # the context is still usable


def test_llama_cpp_python_s_chat_handlers_bring_their_projector(
    seeing: Llama, files: dict[str, Path]
) -> None:
    # llamacrab.compat: Llama(..., chat_handler=Handler(clip_model_path=...)) as written for
    # llama-cpp-python; the projector loads as mmproj does, the model's template renders.
    from llamacrab.compat import Llama as CompatLlama
    from llamacrab.compat import UnsupportedParameterError
    from llamacrab.compat.llama_chat_format import Gemma4ChatHandler, Llava15ChatHandler

    data_url = "data:image/png;base64," + base64.b64encode(encoded(PIXELS, "PNG")).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]}]  # fmt: skip
    native = seeing.create_chat_completion(messages, **GREEDY)
    for handler in (Llava15ChatHandler, Gemma4ChatHandler):
        chat_handler = handler(clip_model_path=str(files["vision"]))
        with CompatLlama(str(files["text"]), n_ctx=512, n_threads=2, verbose=False,
                         chat_handler=chat_handler) as llm:  # fmt: skip
            assert llm.chat_handler is chat_handler
            answer = llm.create_chat_completion(messages, **GREEDY)
        assert answer["usage"]["prompt_tokens"] == native.usage.prompt_tokens > IMAGE_TOKENS
        assert answer["choices"][0]["message"]["content"] == native.choices[0].message.content
    with pytest.raises(InvalidParameterError, match="Clip model path does not exist"):
        Llava15ChatHandler(clip_model_path=str(files["vision"]) + ".missing")
    for not_a_path in (None, 5):  # 5 would be a file descriptor to os.path.exists
        with pytest.raises(InvalidParameterError, match="clip_model_path must be a file path"):
            Llava15ChatHandler(clip_model_path=not_a_path)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="clip_model_path: File name too long"):
        Llava15ChatHandler(clip_model_path="x" * 5000)  # an OSError from exists() before
    on_cpu = Gemma4ChatHandler(str(files["vision"]), use_gpu=False)
    with pytest.raises(UnsupportedParameterError, match="use_gpu=False"):
        CompatLlama(str(files["text"]), verbose=False, chat_handler=on_cpu)
    with pytest.raises(UnsupportedParameterError, match="chat_handler=object"):
        CompatLlama(str(files["text"]), verbose=False, chat_handler=object())


def test_a_projector_refuses_what_its_encodes_could_not_run_on(files: dict[str, Path]) -> None:
    """Thread counts past ggml's bound: each image's encode asks OpenMP for them, and libgomp
    exited the process (600 under a 4 GB address space) or it died of SIGSEGV (100,000)."""
    with Model.load(files["text"]) as model:
        for n_threads in (0, 513, 100_000):
            with pytest.raises(InvalidParameterError, match="n_threads must be an integer"):
                Projector(model, files["vision"], n_threads=n_threads)
        projector = Projector(model, files["audio"], n_threads=2)
        # libmtmd zero-fills the silence it counts: at most as long as a sound it takes.
        longest = MAX_AUDIO_SECONDS * projector.sample_rate
        assert projector.silence_tokens(longest // 3600) > 0
        with pytest.raises(InvalidParameterError, match="n_samples"):
            projector.silence_tokens(longest + 1)
        with pytest.raises(MediaError, match="no audio encoder"):
            Projector(model, files["vision"]).silence_tokens(16_000)


def test_a_prompt_that_tokenizes_to_nothing_is_a_media_error(files: dict[str, Path]) -> None:
    with Model.load(files["text"]) as model:
        projector = Projector(model, files["vision"])
        with pytest.raises(MediaError, match="empty"):  # was an IndexError
            projector.tokenize("", [], add_special=False)
        assert projector.tokenize("", []).n_pos == 1  # the BOS alone


def test_an_encoder_decoder_model_takes_no_projector(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """libmtmd decodes into a T5's decoder with nothing encoded: llama.cpp aborted the process
    at the first image (GGML_ASSERT "llama_encode must be called first", llama-graph.cpp)."""
    t5 = tiny.write_tiny_t5(tmp_path / "t5.gguf")
    with pytest.raises(MediaError, match="encoder-decoder model"):
        Llama(t5, n_ctx=256, mmproj=files["vision"])
    with Model.load(t5) as model, pytest.raises(MediaError, match="without running its encoder"):
        Projector(model, files["vision"])


def test_a_non_causal_image_leaves_a_non_causal_context_as_it_was(tmp_path: Path) -> None:
    """libmtmd turns causal attention off for a Gemma 3 image and then on, whatever it was: an
    embedding model's context computed with a causal mask after one image."""
    convert = load_repo_module("scripts/convert_bert.py")
    ranker = convert.write_tiny_reranker(tmp_path / "ranker.gguf", n_embd=32)
    gemma3 = mmproj.write_tiny_gemma3_mmproj(tmp_path / "gemma3.gguf", n_embd_text=32)
    with Model.load(ranker) as model:
        projector = Projector(model, gemma3)
        context = Context(model, ContextParams(n_ctx=256, n_ubatch=256, embeddings=True))

        def causal() -> bool:
            with context.exclusive() as pointer:
                return bool(lib.llama_get_causal_attn(pointer))

        assert not causal()
        image = projector.bitmap(Image(pixels=PIXELS))
        chunks = projector.tokenize(f"look {projector.marker} now", [image])
        assert projector.evaluate(context, chunks, 0, 0) == chunks.n_pos
        assert not causal()
