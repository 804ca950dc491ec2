"""Hostile images and sounds: files a request could carry, each given to a multimodal Llama.

Sound files are decoded by libmtmd's miniaudio (native code reading untrusted bytes), images by
Pillow, pixel arrays go to the projector as they are. The seeds are small valid files made here:
WAV (integer, float, A-law, mu-law and extensible headers, 1-8 channels, 8-48 kHz), FLAC (a
minimal encoder: verbatim and constant subframes), MP3 (silent MPEG-1/2/2.5 Layer III frames,
with and without an ID3 tag), and PNG, JPEG, GIF, BMP and WebP from Pillow. Each case changes
one to three things: a header field set to a hostile value (a sample rate of 1 Hz, a channel
count of 0, a length past the end, a bit depth of 0 or 255...), a 32-bit value written anywhere,
bytes replaced, inserted or repeated, or the file cut short. Pixel cases are arrays of extreme
shapes. A case's bytes are made in the parent (seeded), so a replay draws the same ones.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from reliability_kit.repo import made_once, script
from reliability_kit.usable import then_still_answers

HOSTILE_32 = (0, 1, 2, 0x7FFF, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE)


# -- sound files ---------------------------------------------------------------------------------


def _tone(rate: int, seconds: float, channels: int) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.5 * np.sin(2 * np.pi * 440 * t)
    return np.repeat(wave[:, None], channels, axis=1)


def wav(rate: int, channels: int, encoding: str, seconds: float = 0.05) -> bytes:
    """A WAV file of a 440 Hz tone; ``encoding``: pcm8, pcm16, pcm24, pcm32, float32, float64,
    alaw, mulaw or extensible (16-bit PCM in a WAVE_FORMAT_EXTENSIBLE header)."""
    samples = _tone(rate, seconds, channels)
    tag, bits = {"pcm8": (1, 8), "pcm16": (1, 16), "pcm24": (1, 24), "pcm32": (1, 32),
                 "float32": (3, 32), "float64": (3, 64), "alaw": (6, 8), "mulaw": (7, 8),
                 "extensible": (0xFFFE, 16)}[encoding]  # fmt: skip
    if encoding == "pcm8" or encoding in ("alaw", "mulaw"):
        data = ((samples + 1) * 127.5).astype(np.uint8).tobytes()
    elif bits == 24:
        ints = (samples * (2**23 - 1)).astype("<i4")
        data = b"".join(int(v).to_bytes(4, "little", signed=True)[:3] for v in ints.flat)
    elif tag == 3:
        data = samples.astype("<f4" if bits == 32 else "<f8").tobytes()
    else:
        data = (samples * (2 ** (bits - 1) - 1)).astype("<i2" if bits == 16 else "<i4").tobytes()
    align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)
    if tag == 0xFFFE:  # cbSize, valid bits, channel mask, the PCM sub-format GUID
        fmt += struct.pack("<HHI", 22, bits, (1 << channels) - 1)
        fmt += b"\x01\x00\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    body = b"WAVE" + _chunk(b"fmt ", fmt) + _chunk(b"data", data)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _chunk(name: bytes, data: bytes) -> bytes:
    return name + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2)


class _Bits:
    def __init__(self) -> None:
        self.value, self.count = 0, 0

    def put(self, value: int, width: int) -> None:
        self.value = (self.value << width) | (value & ((1 << width) - 1))
        self.count += width

    def bytes(self) -> bytes:
        pad = -self.count % 8
        return (self.value << pad).to_bytes((self.count + pad) // 8, "big")


def _crc(data: bytes, poly: int, width: int) -> int:
    crc, top, mask = 0, 1 << (width - 1), (1 << width) - 1
    for byte in data:
        crc ^= byte << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ poly) & mask if crc & top else (crc << 1) & mask
    return crc


def flac(rate: int, channels: int, constant: bool, block: int = 256, blocks: int = 3) -> bytes:
    """A 16-bit FLAC file of ``blocks`` frames: verbatim subframes of a tone, or constant ones."""
    samples = (_tone(rate, block * blocks / rate, channels) * 32767).astype(int)
    info = _Bits()
    for value, width in ((block, 16), (block, 16), (0, 24), (0, 24), (rate, 20),
                         (channels - 1, 3), (15, 5), (block * blocks, 36)):  # fmt: skip
        info.put(value, width)
    out = b"fLaC" + bytes([0x80, 0, 0, 34]) + info.bytes() + bytes(16)  # last block: STREAMINFO
    for number in range(blocks):
        header = _Bits()
        # sync, fixed block size, block size from the end of the header (16 bits), the rate and
        # sample size from STREAMINFO, independent channels, the frame number (< 128: 1 byte)
        for value, width in ((0x3FFE, 14), (0, 2), (7, 4), (0, 4), (channels - 1, 4), (0, 3),
                             (0, 1), (number, 8), (block - 1, 16)):  # fmt: skip
            header.put(value, width)
        head = header.bytes()
        frame = _Bits()
        for channel in range(channels):
            column = samples[number * block : (number + 1) * block, channel]
            # A zero bit, the subframe type (constant 0, verbatim 1), no wasted bits.
            frame.put(0 if constant else 2, 8)
            for value in column[:1] if constant else column:
                frame.put(int(value), 16)
        body = head + bytes([_crc(head, 0x07, 8)]) + frame.bytes()
        out += body + struct.pack(">H", _crc(body, 0x8005, 16))
    return out


_MP3_RATES = {1: (44100, 48000, 32000), 2: (22050, 24000, 16000), 25: (11025, 12000, 8000)}
_MP3_KBPS = {1: (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
             2: (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}  # fmt: skip


def mp3(version: int, rate_index: int, rate_kbps_index: int, stereo: bool, frames: int = 12,
        id3: bool = False) -> bytes:  # fmt: skip
    """Silent Layer III frames (all-zero side information) of MPEG ``version`` 1, 2 or 25."""
    version_bits = {1: 3, 2: 2, 25: 0}[version]
    kbps = _MP3_KBPS[1 if version == 1 else 2][rate_kbps_index]
    rate = _MP3_RATES[version][rate_index]
    length = (144 if version == 1 else 72) * kbps * 1000 // rate
    header = bytes([0xFF, 0xE0 | version_bits << 3 | 1 << 1 | 1,  # Layer III, no CRC
                    (rate_kbps_index + 1) << 4 | rate_index << 2,
                    (0 if stereo else 3) << 6])  # fmt: skip
    out = (header + bytes(length - 4)) * frames
    if id3:
        tag = b"TIT2" + struct.pack(">I", 6) + b"\0\0\0silly"  # one text frame
        out = b"ID3\x03\x00\x00" + bytes([0, 0, len(tag) >> 7, len(tag) & 0x7F]) + tag + out
    return out


# -- images --------------------------------------------------------------------------------------


def image(kind: str, height: int, width: int) -> bytes:
    from PIL import Image as PILImage

    pixels = np.random.default_rng(height * width).integers(0, 256, (height, width, 3), np.uint8)
    buffer = io.BytesIO()
    PILImage.fromarray(pixels).save(buffer, format=kind)
    return buffer.getvalue()


def png_of_size(width: int, height: int) -> bytes:
    """A greyscale PNG of one colour claiming width x height, rows compressed as they come."""
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(bytes(width + 1)) for _ in range(height))
    data += packer.flush()

    def chunk(name: bytes, payload: bytes) -> bytes:
        body = name + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND",
                                                                                   b"")  # fmt: skip


# -- the cases -----------------------------------------------------------------------------------


def seeds() -> list[tuple[str, str, bytes, list[tuple[int, int]]]]:
    """(name, kind, bytes, header fields as (offset, size)) of every seed file."""
    out: list[tuple[str, str, bytes, list[tuple[int, int]]]] = []
    wav_fields = [(4, 4), (16, 4), (20, 2), (22, 2), (24, 4), (28, 4), (32, 2), (34, 2), (40, 4)]
    for encoding in ("pcm8", "pcm16", "pcm24", "pcm32", "float32", "float64", "alaw", "mulaw"):
        for rate, channels in ((16000, 1), (8000, 2), (44100, 1), (48000, 6)):
            out.append((f"wav-{encoding}-{rate}-{channels}", "audio", wav(rate, channels, encoding),
                        wav_fields))  # fmt: skip
    out.append(("wav-extensible", "audio", wav(22050, 2, "extensible"),
                [*wav_fields[:-1], (36, 2), (38, 2), (40, 4), (44, 4), (64, 4)]))  # fmt: skip
    flac_fields = [(8, 2), (10, 2), (12, 3), (15, 3), (18, 3), (20, 2), (21, 1), (22, 4)]
    for rate, channels, constant in ((16000, 1, False), (44100, 2, False), (8000, 1, True),
                                     (96000, 8, True)):  # fmt: skip
        out.append((f"flac-{rate}-{channels}-{'c' if constant else 'v'}", "audio",
                    flac(rate, channels, constant), flac_fields))  # fmt: skip
    for version, rate_index, kbps_index, stereo, id3 in ((1, 0, 8, False, False),
                                                         (1, 1, 13, True, True),
                                                         (2, 2, 7, False, False),
                                                         (25, 2, 0, True, True)):  # fmt: skip
        fields = [(0, 4), (10, 4), (6, 4)] if id3 else [(0, 4), (1, 2), (2, 2), (4, 4)]
        out.append((f"mp3-{version}-{rate_index}{'-id3' if id3 else ''}", "audio",
                    mp3(version, rate_index, kbps_index, stereo, id3=id3), fields))  # fmt: skip
    for kind in ("PNG", "JPEG", "GIF", "BMP", "WEBP"):
        out.append((f"image-{kind.lower()}", "image", image(kind, 24, 32), [(16, 4), (20, 4)]))
    out.append(("image-png-tall", "image", png_of_size(1, 40_000), [(16, 4), (20, 4)]))
    return out


def _mutated(data: bytes, fields: list[tuple[int, int]], rng: random.Random) -> tuple[bytes, str]:
    out, steps = bytearray(data), []
    for _ in range(rng.randint(1, 3)):
        choice = rng.random()
        at = rng.randrange(len(out)) if out else 0
        if choice < 0.45 and fields:
            offset, size = rng.choice(fields)
            value = rng.choice([0, 1, 2, 3, 255, 2**(8 * size) - 1, 2**(8 * size - 1),
                                rng.randrange(2**(8 * size))])  # fmt: skip
            out[offset : offset + size] = value.to_bytes(size, "little")[:size]
            steps.append(f"field@{offset}={value}")
        elif choice < 0.6:
            value = rng.choice(HOSTILE_32)
            out[at : at + 4] = struct.pack("<I", value)
            steps.append(f"u32@{at}={value:#x}")
        elif choice < 0.75:
            for _ in range(rng.randint(1, 8)):
                out[rng.randrange(len(out))] = rng.randrange(256)
            steps.append("bytes")
        elif choice < 0.85:
            cut = rng.randrange(len(out))
            del out[max(cut, 12) :]
            steps.append(f"cut@{cut}")
        elif choice < 0.95:
            length = rng.randint(1, 64)
            out[at:at] = out[at : at + length] * rng.randint(2, 20)
            steps.append(f"repeat@{at}")
        else:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
            steps.append(f"insert@{at}")
    return bytes(out), " ".join(steps)


PIXEL_SHAPES = ((1, 1), (1, 2), (2, 1), (1, 4096), (4096, 1), (3, 1000), (1000, 3), (7, 7),
                (1, 49_999), (0, 5), (5, 0))  # fmt: skip


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` cases: every seed file once, unchanged, every pixel shape, then mutations."""
    rng = random.Random(seed)
    files = seeds()
    cases: list[dict[str, Any]] = []
    for name, kind, data, _ in files:
        cases.append({"kind": kind, "what": f"{name} as made", "data": data.hex()})
    for height, width in PIXEL_SHAPES:
        cases.append({"kind": "pixels", "what": f"{height}x{width} pixels",
                      "shape": [height, width]})  # fmt: skip
    while len(cases) < count:
        name, kind, data, fields = rng.choice(files)
        mutated, steps = _mutated(data, fields, rng)
        cases.append({"kind": kind, "what": f"{name}: {steps}", "data": mutated.hex()})
    for index, case in enumerate(cases[:count]):
        case["id"] = f"media-{seed}-{index}"
    return cases[:count]


def projectors(workdir: Path) -> dict[str, str]:
    """The tiny vision and audio projectors (scripts/make_tiny_mmproj.py), made once."""
    make_mmproj = script("make_tiny_mmproj")
    writers = {"vision": make_mmproj.write_tiny_vision_mmproj,
               "audio": make_mmproj.write_tiny_audio_mmproj}  # fmt: skip
    return made_once(workdir, "tiny-{}-mmproj.gguf", writers)


# -- the child's side ----------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    """A seeing and a hearing Llama, kept across the cases (a refusal must leave them usable)."""
    from llamacrab import Llama

    models = config["models"]
    return {
        "image": Llama(models["text"], n_ctx=512, n_threads=1, mmproj=models["vision"]),
        "audio": Llama(models["text"], n_ctx=2048, n_threads=1, mmproj=models["audio"]),
    }


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    """The file (or the pixels) in a completion; a LlamaError out of here is the expected
    refusal, and either way the same Llama must answer a plain prompt afterwards."""
    from llamacrab import Audio, Image

    kind = case["kind"]
    llm = state["audio" if kind == "audio" else "image"]
    if kind == "pixels":
        media: Any = Image(pixels=np.full((*case["shape"], 3), 200, np.uint8))
    else:
        data = bytes.fromhex(case["data"])
        media = Audio(data=data) if kind == "audio" else Image(data=data)

    def complete() -> str:
        result = llm.create_completion(f"{llm.media_marker} then", media=[media], max_tokens=2,
                                       temperature=0)  # fmt: skip
        return f"{result.usage.prompt_tokens} prompt tokens"

    return then_still_answers(llm, complete, "file")
