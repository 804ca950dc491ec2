"""Untrusted inputs that must fail with llamacrab's own error, quickly and without a huge
allocation: image dimensions and files, sound lengths, saved-state blobs, and chat templates
that build big values."""

from __future__ import annotations

import hashlib
import io
import re
import struct
import time
import tracemalloc
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import xxhash
from PIL import Image as PILImage

from llamacrab import (
    Batch,
    Context,
    ContextParams,
    InvalidParameterError,
    MediaError,
    Model,
    SamplerChain,
    StateError,
    TemplateError,
)
from llamacrab._chat.template import MAX_INT_BITS, MAX_VALUE_SIZE, render
from llamacrab._native import media, state
from llamacrab._native.media import (
    MAX_AUDIO_SECONDS,
    MAX_IMAGE_PIXELS,
    Audio,
    Image,
    pcm_for_rate,
    rgb_pixels,
)
from llamacrab._native.state import SavedState

# -- images ----------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _blank_png(width: int, height: int) -> bytes:
    """A valid greyscale PNG of one colour, compressed row by row (never held decoded)."""
    packer = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte 0, then black pixels
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", data)
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("side", [9_000, 20_000])  # under and over Pillow's own bomb limit
def test_a_huge_image_is_refused_before_it_is_decoded(side: int) -> None:
    png = _blank_png(side, side)
    assert len(png) < 1_000_000 and side * side > MAX_IMAGE_PIXELS
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(MediaError, match=f"limit of {MAX_IMAGE_PIXELS} pixels"):
            rgb_pixels(Image(data=png))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 2
    assert peak < 20_000_000  # decoded, the 9000 x 9000 one is 243 MB of RGB


def test_pixel_arrays_are_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # A broadcast view claims 60 megapixels while holding 3 bytes.
    huge = np.broadcast_to(np.zeros(3, dtype=np.uint8), (6_000, 10_000, 3))
    with pytest.raises(MediaError, match=f"limit of {MAX_IMAGE_PIXELS} pixels"):
        rgb_pixels(Image(pixels=huge))
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(MediaError, match="limit of 100 pixels"):
        rgb_pixels(Image(pixels=np.zeros((11, 10), dtype=np.uint8)))
    assert rgb_pixels(Image(pixels=np.zeros((10, 10), dtype=np.uint8))).shape == (10, 10, 3)
    small = io.BytesIO()
    PILImage.new("RGB", (10, 10), "red").save(small, format="PNG")
    assert rgb_pixels(Image(data=small.getvalue())).shape == (10, 10, 3)
    PILImage.new("RGB", (10, 11), "red").save(small := io.BytesIO(), format="PNG")
    with pytest.raises(MediaError, match="limit of 100 pixels"):
        rgb_pixels(Image(data=small.getvalue()))


def test_any_error_pillow_raises_on_a_broken_file_is_a_media_error() -> None:
    header = struct.pack(">IIBBBBB", 4, 4, 8, 0, 0, 0, 0)
    rows = zlib.compress(bytes(5) * 4)
    valid = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", rows)
    valid += _chunk(b"IEND", b"")
    assert rgb_pixels(Image(data=valid)).shape == (4, 4, 3)
    # An empty IDAT, then a chunk whose type is not four letters: Pillow's load() raises
    # SyntaxError("broken PNG file") (found by fuzzing; not an OSError or a ValueError).
    bad_chunk = bytes(4) + struct.pack(">I", 5) + b"_\x82\xc2z"
    broken = valid[:33] + struct.pack(">I", 0) + b"IDAT" + bad_chunk + rows
    with pytest.raises(SyntaxError):
        PILImage.open(io.BytesIO(broken)).load()
    with pytest.raises(MediaError, match=r"could not decode the image.*broken PNG file"):
        rgb_pixels(Image(data=broken))
    # Pillow names the stream it was given, an object's repr; the message ends at the reason.
    with pytest.raises(MediaError, match=r"\(19 bytes\): cannot identify image file$"):
        rgb_pixels(Image(data=b"not an image at all"))


# -- sounds ----------------------------------------------------------------------------------


def test_samples_at_a_low_rate_are_refused_before_resampling() -> None:
    # 100,000 samples declared at 1 Hz: 28 hours, 1.6 billion samples at 16 kHz.
    low = Audio(samples=np.zeros(100_000, np.float32), sample_rate=1)
    tracemalloc.start()
    try:
        with pytest.raises(MediaError, match=f"limit of {MAX_AUDIO_SECONDS} seconds"):
            pcm_for_rate(low, 16_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000
    hour = Audio(samples=np.zeros(MAX_AUDIO_SECONDS * 2, np.float32), sample_rate=2)
    assert len(pcm_for_rate(hour, 16)) == MAX_AUDIO_SECONDS * 16  # at the limit: resampled
    wide = np.broadcast_to(np.zeros(1, np.float32), (16_000, 1_000_000))  # 64 GB as float32
    with pytest.raises(MediaError, match="1000000 channels; the limit is 64"):
        pcm_for_rate(Audio(samples=wide, sample_rate=16_000), 16_000)
    with pytest.raises(MediaError, match="must be numbers"):
        pcm_for_rate(Audio(samples=np.array(["a", "b"]), sample_rate=16_000), 16_000)


# -- saved states ----------------------------------------------------------------------------


def _sealed(body: bytes) -> bytes:
    """``body`` with a valid checksum: sha256 for formats 1 and 2, XXH3-128 from 3."""
    if struct.unpack_from("<I", body, 8)[0] >= 3:
        return body + xxhash.xxh3_128(body).digest()
    return body + hashlib.sha256(body).digest()


def _head(n_tokens: int, *, version: int = 1, scope: int = 0) -> bytes:
    return state._HEAD.pack(state.MAGIC, version, scope, 512, b"m" * 32, n_tokens)


GOOD = SavedState((1, 2, 3), b"payload", b"m" * 32, 512)
FINGERPRINT = b"f" * 32


def _v2_body(version: int = 2) -> bytes:
    """A format-2 (or 3) state of three tokens up to its payload: checkpoints follow."""
    tokens = struct.pack("<3i", 1, 2, 3)
    return _head(3, version=version) + tokens + struct.pack("<Q", 7) + b"payload"


def _v3_body() -> bytes:
    """GOOD as format 3 wrote it, checksum included."""
    return _sealed(_v2_body(3) + struct.pack("<I", 0))


def _v5_body() -> bytes:
    """GOOD with a KV fingerprint, as the present format writes it, checksum included."""
    blob = replace(GOOD, kv_fingerprint=FINGERPRINT).to_bytes()
    assert struct.unpack_from("<I", blob, 8)[0] == 5
    return blob


@pytest.mark.parametrize(
    "blob",
    [
        _sealed(_head(2**32 - 1) + struct.pack("<Q", 0)),  # more tokens than bytes
        _sealed(_head(3) + b"\x00" * 12),  # tokens, then no payload length
        _sealed(_head(3) + b"\x00" * 13),  # half a payload length
        _sealed(_head(1) + b"\x00" * 4 + struct.pack("<Q", 2**64 - 1) + b"xx"),  # length lies
        _sealed(_head(0, version=7) + struct.pack("<Q", 0)),
        _sealed(_head(0, scope=2**32 - 1) + struct.pack("<Q", 0)),
        _sealed(state.MAGIC + b"\x00" * 40),  # too short for a header, long enough to sniff
        GOOD.to_bytes()[:-1] + b"\x00",
        # Format 2's checkpoints: a count with nothing after it, a size past the end, bytes
        # after the last one, one after more tokens than the state has, one after none.
        _sealed(_v2_body() + struct.pack("<I", 2**32 - 1)),
        _sealed(_v2_body() + struct.pack("<IIQ", 1, 2, 2**63) + b"x"),
        _sealed(_v2_body() + struct.pack("<IIQ", 1, 2, 1) + b"xy"),
        _sealed(_v2_body() + struct.pack("<IIQ", 1, 4, 1) + b"x"),
        _sealed(_v2_body() + struct.pack("<IIQ", 1, 0, 1) + b"x"),
        _sealed(_v2_body()),  # no checkpoint count at all
        # Format 3 checks with XXH3-128: a sha256 after it, a cut checksum, a lying length.
        _v3_body()[:-16] + hashlib.sha256(_v3_body()[:-16]).digest(),
        _v3_body()[:-1],
        _sealed(_v3_body()[:-16].replace(struct.pack("<Q", 7), struct.pack("<Q", 8))),
        _sealed(state.MAGIC + struct.pack("<I", 3)),  # a header cut after the version
        # Format 4 adds a KV fingerprint after the head: cut inside it, tokens past the end.
        _sealed(_head(0, version=4) + b"f" * 31),
        _sealed(_head(3, version=4) + FINGERPRINT + struct.pack("<3i", 1, 2, 3)),
        _sealed(_head(0, version=5) + b"f" * 31),
        b"",
        "a string, not bytes",
        np.zeros(40, dtype=np.int64)[::2],  # bytes-like but not contiguous
    ],
)
def test_every_malformed_state_raises_state_error(blob: bytes, tmp_path: object) -> None:
    with pytest.raises(StateError):
        SavedState.from_bytes(blob)


def test_states_still_round_trip(tmp_path: object) -> None:
    blob = GOOD.to_bytes()
    assert SavedState.from_bytes(blob) == GOOD
    assert SavedState.from_bytes(bytearray(blob)) == GOOD
    assert SavedState.from_bytes(memoryview(blob)) == GOOD
    empty = SavedState((), b"", b"m" * 32, 512, "context")
    assert SavedState.from_bytes(empty.to_bytes()) == empty
    marked = SavedState((1, 2, 3), b"payload", b"m" * 32, 512,
                        checkpoints=(state.StateCheckpoint(2, b"cells"),))  # fmt: skip
    assert SavedState.from_bytes(marked.to_bytes()) == marked
    assert SavedState.from_bytes(_sealed(_v2_body() + struct.pack("<I", 0))) == GOOD
    # Format 3 is format 2 with another checksum; neither records a KV fingerprint.
    assert SavedState.from_bytes(_v3_body()) == GOOD and GOOD.kv_fingerprint is None
    # Format 5 is format 3 with the fingerprint after the head (zeros: none recorded).
    fingerprinted = SavedState.from_bytes(_v5_body())
    assert fingerprinted == replace(GOOD, kv_fingerprint=FINGERPRINT) != GOOD
    v3, at = _v3_body()[:-16], state._HEAD.size
    v5_head = v3[:8] + struct.pack("<I", 5) + v3[12:at]
    assert _v5_body() == _sealed(v5_head + FINGERPRINT + v3[at:])
    assert blob == _sealed(v5_head + bytes(32) + v3[at:])
    # Format 4 has the same layout, its fingerprint of an earlier form: read as none.
    v4_head = v3[:8] + struct.pack("<I", 4) + v3[12:at]
    assert SavedState.from_bytes(_sealed(v4_head + FINGERPRINT + v3[at:])) == GOOD
    for wrong in (b"short", bytes(32)):
        with pytest.raises(StateError, match="KV fingerprint"):
            replace(GOOD, kv_fingerprint=wrong)


def test_lengths_a_state_file_cannot_hold_are_refused_before_it_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sparse file of 1 GiB that opens as a state of three tokens: its lengths do not add up
    to its size, and it is refused without hashing the gigabyte of zeros after them (a 3 GiB
    one took 16 s to hash before its refusal: a server's slot restore)."""
    hashed: list[int] = []
    checksum = state._CHECKSUMS[state.FORMAT_VERSION]

    def counted(*data: bytes) -> object:
        hashed.extend(len(block) for block in data)
        return checksum(*data)

    monkeypatch.setitem(state._CHECKSUMS, state.FORMAT_VERSION, counted)
    path = tmp_path / "sparse.state"
    with path.open("wb") as file:
        file.write(GOOD.to_bytes()[:64])
        file.truncate(1 << 30)
    with pytest.raises(StateError, match="bytes follow the state's checkpoints"):
        SavedState.load(path)
    assert hashed == []
    assert SavedState.from_bytes(GOOD.to_bytes()) == GOOD and hashed  # (the count counts)


# -- chat templates --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 100000000 }}",
        "{{ 100000000 * 'x' }}",
        "{{ ['x'] * 100000000 }}",
        "{% set s = 'x' * 600000 %}{{ (s + s)|length }}",
        "{% set s = 'x' * 600000 %}{{ [s, s]|join }}",
        "{% set s = 'x' * 600000 %}{{ ',' .join([s, s]) }}",
        "{{ 'x'.ljust(1000000000) }}",
        "{{ 'x'|center(1000000000) }}",
        "{{ ('x' * 1000)|replace('', 'y' * 1000) }}",
        "{{ '%1000000000d' % 1 }}",
        "{{ '%*d' % (1000000000, 1) }}",
        "{{ '%1000000000d'|format(1) }}",
        # Found by a hostile-input hunt (each took gigabytes in one step before):
        "{{ '{:>3000000000}'.format('a') }}",
        "{{ '{0:.3000000000}'.format(1.5) }}",
        "{% set s = 'x' * 999999 %}{{ ('{0}' * 1000).format(s) }}",
        "{% set s = 'x' * 999999 %}{{ ('{a}' * 1000).format_map({'a': s}) }}",
        "{% set s = 'x' * 999999 %}{{ ('%(a)s' * 1000) % {'a': s} }}",
        "{{ 'x'.encode() * 3000000000 }}",
        "{{ 'x'.encode().ljust(3000000000) }}",
        "{{ 'x'.encode().center(3000000000) }}",
        "{% set s = 'x' * 999999 %}{{ ('a' * 1000).translate({97: s}) }}",
        "{{ range(100000)|list|tojson(separators=(',' * 60, ':')) * 1 }}",
        "{{ [[[[[[range(30000)|list]]]]]]|tojson(indent=60) }}",
    ],
)
def test_templates_cannot_build_huge_values(source: str) -> None:
    started = time.perf_counter()
    with pytest.raises(TemplateError, match=f"limit of {MAX_VALUE_SIZE}"):
        render(source, [])
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("{{ [1]|tojson(indent=' ' * 999999) }}", "indentation or separator of 999999"),
        ("{{ [1, 2]|tojson(separators=(' ' * 30000, ':')) }}", "separator of 30000"),
        ("{{ [1]|tojson(indent=65) }}", "indentation or separator of 65"),
        ("{{ '{:{}}'.format('a', 5) }}", "nests a field in a format spec"),
        ("{{ '{'.format(1) }}", "format string is invalid"),
    ],
)
def test_templates_cannot_hide_a_size_from_the_checks(source: str, problem: str) -> None:
    with pytest.raises(TemplateError, match=re.escape(problem)):
        render(source, [])


def test_templates_cannot_build_huge_integers() -> None:
    for source in ("{{ 7 ** 1000000000 }}", "{% set n = 2 ** 9000 %}{{ n * n }}"):
        with pytest.raises(TemplateError, match=f"limit of {MAX_INT_BITS} bits"):
            render(source, [])


def test_ordinary_templates_still_render() -> None:
    source = (
        "{{ '-' * 3 }}{{ [1] * 2 + [3] }}{{ 2 ** 10 }}{{ 'a' ~ 'b' }}{{ '%03d|%s' % (7, 'x') }}"
        "{{ ['p', 'q']|join(',') }}{{ 'abc'|replace('b', 'B') }}{{ 'z'.rjust(3, '.') }}"
        "{{ [[1], [2]]|sum(start=[]) }}{{ 'x'|indent(2) }}{{ '%s!'|format('hi') }}"
        "{{ '{:>4}|{:.2f}|{name}'.format('a', 1.5, name='n') }}{{ {'a': [1]}|tojson(indent=2) }}"
        "{{ [1, 2]|tojson(separators=(',', ':')) }}{{ 'ab'.encode().center(4).decode() }}"
    )
    assert render(source, []) == (
        '---[1, 1, 3]1024ab007|xp,qaBc..z[1, 2]xhi!   a|1.50|n{\n  "a": [\n    1\n  ]\n}[1,2] ab '
    )


def test_a_template_may_change_what_it_built_but_not_what_it_was_given() -> None:
    queue = (
        "{% set q = namespace(ids=[]) %}{% set _ = q.ids.append('a') %}{% set _ = q.ids.append('b')"
        " %}{{ q.ids.pop(0) }}{% set d = {} %}{% set _ = d.update({'k': 1}) %}{{ d|tojson }}"
        "{{ q.ids }}"
    )
    assert render(queue, []) == "a{\"k\": 1}['b']"
    messages = [{"role": "user", "content": "hi", "parts": ["x"]}]
    for hostile in ("{% set _ = messages.append(1) %}", "{% set _ = messages[0].update(a=1) %}",
                    "{% set _ = messages[0].parts.append(1) %}"):  # fmt: skip
        with pytest.raises(TemplateError, match=r"not allowed|unsafe"):
            render(hostile, messages)
    assert messages == [{"role": "user", "content": "hi", "parts": ["x"]}]
    doubling = "{% set l = ['x'] %}{% for i in range(40) %}{% set _ = l.extend(l) %}{% endfor %}"
    started = time.perf_counter()
    with pytest.raises(TemplateError, match=f"limit of {MAX_VALUE_SIZE}"):
        render(doubling, [])
    assert time.perf_counter() - started < 1


def test_templates_get_what_real_templates_use() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    source = (
        "{{ tools|map(attribute='function')|tojson }}|{{ '{\"a\": [1]}'|from_json }}|"
        "{% generation %}kept{% endgeneration %}|{{ nothing.at.all }}|{{ 'x' + none }}|"
        "{{ undefined_name + 'y' }}"
    )
    assert render(source, [], tools=tools) == (
        '[{"name": "f", "parameters": {}}]|{\'a\': [1]}|kept||x|y'
    )


# -- integers on their way to C ------------------------------------------------------------------


def test_numbers_c_cannot_take_are_refused_not_wrapped(tiny_model_path: Path) -> None:
    # numpy's assignment wrapped token 2**40 to token 0 and truncated 1.5; cffi raised a bare
    # OverflowError or TypeError for a delta, an index or a position past int32.
    batch = Batch(8, n_seq_max=2)
    for tokens in (np.array([1, 2**40]), np.array([1.5]), np.array([True])):
        with pytest.raises(InvalidParameterError, match="tokens must be integers within int32"):
            batch.set(tokens, 0)
    with pytest.raises(InvalidParameterError, match="positions must be integers"):
        batch.set_rows(np.array([1]), np.array([2**33]), np.array([0]), np.array([1]))
    with pytest.raises(InvalidParameterError, match="seq_ids must be integers"):
        batch.set_rows(np.array([1]), np.array([0]), np.array([0.5]), np.array([1]))
    with pytest.raises(InvalidParameterError, match="differ in length"):
        batch.set_rows(np.array([1, 2]), np.array([0]), np.array([0, 0]), np.array([1, 1]))
    context = Context(Model.load(tiny_model_path), ContextParams(n_ctx=64, embeddings=True))
    batch.set(np.array([1, 260, 261]), 0)
    context.decode(batch)
    refused = [
        (lambda: context.shift(0, 2**31), "delta"),
        (lambda: context.divide(0, 2**31), "divisor"),
        (lambda: context.remove(0, 0, 2**32), "p1"),
        (lambda: context.remove(0.5, 0), "seq_id"),  # type: ignore[arg-type]
        (lambda: context.logits(2**31), "index"),
        (lambda: context.embeddings(64, index=2**31), "index"),
        (lambda: context.embeddings(64, seq_id=2**31), "seq_id"),
        (lambda: context.embeddings(64, count=2**40), "count"),
        (lambda: SamplerChain(context.model).sample(context, 2**31), "index"),
        (lambda: SamplerChain(context.model).sample(context, 1.5), "index"),  # type: ignore[arg-type]
    ]
    for attempt, name in refused:
        with pytest.raises(InvalidParameterError, match=f"^{name} must be an integer"):
            attempt()
    assert context.logits().shape == (context.n_vocab,)  # the context goes on
