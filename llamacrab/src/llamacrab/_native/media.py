"""Images and sounds given to a multimodal model: encoded bytes or arrays (RGB pixels; float32
PCM with its sample rate). Image files are decoded with Pillow (the ``media`` extra); sound
files (WAV, MP3, FLAC) by libmtmd, resampled to the projector's rate. Bytes are recognized by
their signature first: anything else is refused before native code sees it."""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamacrab._exceptions import MediaError
from llamacrab._field_types import is_number

# The most pixels (width x height) an image may have, decoded or given as an array: 50
# megapixels is 150 MB of RGB. An encoded file's size says nothing about this (a PNG of one
# colour compresses about a thousandfold), so the header's dimensions are checked before a
# single pixel is decoded.
MAX_IMAGE_PIXELS = 50_000_000
# The longest sound, in seconds (an hour at 16 kHz is 230 MB of float samples). A sound file's
# header sets its sample rate: a few kB declaring 1 Hz would resample to gigabytes. Sound files
# are held to it by libmtmd (the mtmd-audio-length-bound patch: a fixed hour), samples here.
MAX_AUDIO_SECONDS = 3600
MAX_AUDIO_CHANNELS = 64  # of samples given as an array (averaged to mono)


@dataclass(frozen=True, eq=False)
class Image:
    """An image: ``data`` (an encoded file's bytes) or ``pixels`` (an (height, width, 3) uint8
    RGB array; (h, w) grey and (h, w, 4) RGBA are converted)."""

    data: bytes | None = None
    pixels: np.ndarray | None = None

    def __post_init__(self) -> None:
        _one_source(self.data, self.pixels, "pixels")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Image:
        return cls(data=Path(path).read_bytes())


@dataclass(frozen=True, eq=False)
class Audio:
    """A sound: ``data`` (an encoded file's bytes) or ``samples`` (float32 PCM in [-1, 1], mono,
    or (n, channels) which is averaged) recorded at ``sample_rate`` Hz."""

    data: bytes | None = None
    samples: np.ndarray | None = None
    sample_rate: int | None = None

    def __post_init__(self) -> None:
        _one_source(self.data, self.samples, "samples")
        rate = self.sample_rate
        if self.samples is not None and not (is_number(rate) and math.isfinite(rate) and rate > 0):
            raise MediaError(f"audio samples need their sample_rate in Hz, not {rate!r}")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Audio:
        return cls(data=Path(path).read_bytes())


Media = Image | Audio


def encoded_media(data: bytes) -> Media:
    """An encoded file's bytes as the image or the sound its signature says they hold."""
    return Audio(data=data) if sniff(data) == "audio" else Image(data=data)


def _one_source(data: bytes | None, array: np.ndarray | None, name: str) -> None:
    if (data is None) == (array is None):
        raise MediaError(f"give either data (encoded bytes) or {name}, not both or neither")
    if data is not None and not isinstance(data, bytes | bytearray):
        raise MediaError(f"data must be a file's bytes, not {type(data).__name__}")
    if data is not None and not data:
        raise MediaError("the media data is empty")


_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM", b"GIF87a", b"GIF89a")


def sniff(data: bytes) -> str:
    """ "image" or "audio", from the file signature (audio: as libmtmd recognizes it)."""
    if (
        len(data) >= 12
        and (
            (data[:4] == b"RIFF" and data[8:12] == b"WAVE")
            or data[:3] == b"ID3"
            or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)  # an MPEG frame
            or data[:4] == b"fLaC"
        )
    ):
        return "audio"
    if data.startswith(_IMAGE_SIGNATURES) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return "image"
    raise MediaError("unrecognized media format (images: PNG, JPEG, BMP, GIF, WebP; audio: "
                     "WAV, MP3, FLAC)")  # fmt: skip


def check_wav_format_chunks(data: bytes) -> None:
    """Refuse a WAV file whose format chunk would make libmtmd's decoder (miniaudio's dr_wav)
    loop for ever: after the chunk's 18 bytes and the extension its size field announces, dr_wav
    seeks by the chunk's size less both as an int, so a size smaller than that (or past 2 GiB)
    moves it backwards to a chunk it read before (found by the media section, seed 2035)."""
    if not (data[:4] == b"RIFF" and data[8:12] == b"WAVE"):
        return
    offset = 12
    while offset + 8 <= len(data):  # the chunks dr_wav visits: those up to the first "data"
        chunk = data[offset : offset + 4]
        size = int.from_bytes(data[offset + 4 : offset + 8], "little")
        if chunk == b"data":
            return
        if chunk == b"fmt " and size > 16 and offset + 26 <= len(data):
            extension = int.from_bytes(data[offset + 24 : offset + 26], "little")
            left = size - 18 - extension
            if not 0 <= left <= 0x7FFFFFFF:
                raise MediaError(
                    f"the WAV file's format chunk is {size} bytes long but holds a "
                    f"{extension}-byte extension after its 18 bytes"
                )
        offset += 8 + size + (size & 1)


def _check_pixel_count(width: int, height: int) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(
            f"the image is {width}x{height} = {width * height} pixels, over the limit of "
            f"{MAX_IMAGE_PIXELS} pixels (llamacrab._native.media.MAX_IMAGE_PIXELS)"
        )


def decode_image(data: bytes) -> np.ndarray:
    """RGB pixels of an encoded image, decoded by Pillow. The dimensions in its header are
    checked against MAX_IMAGE_PIXELS before anything is decoded (Pillow opens lazily)."""
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise MediaError(
            "decoding image files needs Pillow: pip install 'llamacrab[media]'"
        ) from None

    stream = io.BytesIO(data)
    try:
        with PILImage.open(stream) as opened:
            _check_pixel_count(*opened.size)  # read from the header: nothing decoded yet
            return np.asarray(opened.convert("RGB"))
    except PILImage.DecompressionBombError as error:  # Pillow's own, larger limit
        raise MediaError(
            f"the image is over the limit of {MAX_IMAGE_PIXELS} pixels "
            f"(llamacrab._native.media.MAX_IMAGE_PIXELS): {error}"
        ) from None
    except Exception as error:  # Pillow's decoders raise SyntaxError, struct.error, EOFError,
        # ... on malformed files as well as OSError and ValueError
        reason = str(error).replace(f" {stream!r}", "")  # "cannot identify image file <_io...>"
        raise MediaError(f"could not decode the image ({len(data)} bytes): {reason}") from None


def rgb_pixels(image: Image) -> np.ndarray:
    """Contiguous (height, width, 3) uint8 RGB."""
    pixels = np.asarray(image.pixels) if image.data is None else decode_image(image.data)
    if pixels.ndim in (2, 3):  # before any conversion copies them
        _check_pixel_count(pixels.shape[1], pixels.shape[0])
    if pixels.dtype != np.uint8:
        raise MediaError(f"pixels must be uint8 (0..255), not {pixels.dtype}")
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[:, :, None], 3, axis=2)
    elif pixels.ndim == 3 and pixels.shape[2] == 4:
        pixels = pixels[:, :, :3]
    if pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise MediaError(f"pixels must be (height, width, 3) RGB, not shape {pixels.shape}")
    return np.ascontiguousarray(pixels)


def pcm_for_rate(audio: Audio, rate: int) -> np.ndarray:
    """Mono float32 PCM at ``rate`` Hz (linear resampling when the recording's rate differs)."""
    given = np.asarray(audio.samples)  # its length is checked before any copy or conversion
    if given.ndim not in (1, 2):
        raise MediaError(f"audio samples must be (n,) or (n, channels), not {given.shape}")
    assert audio.sample_rate is not None
    seconds = given.shape[0] / audio.sample_rate
    if seconds > MAX_AUDIO_SECONDS:  # resampling would allocate rate / sample_rate times more
        raise MediaError(
            f"the audio lasts {seconds:.0f} seconds ({given.shape[0]} samples at "
            f"{audio.sample_rate} Hz), over the limit of {MAX_AUDIO_SECONDS} seconds "
            "(llamacrab._native.media.MAX_AUDIO_SECONDS)"
        )
    if given.ndim == 2 and given.shape[1] > MAX_AUDIO_CHANNELS:
        raise MediaError(f"the audio has {given.shape[1]} channels; the limit is "
                         f"{MAX_AUDIO_CHANNELS} (samples are (n,) or (n, channels))")  # fmt: skip
    try:
        samples = given.astype(np.float32, copy=False)
    except (TypeError, ValueError) as error:
        raise MediaError(f"audio samples must be numbers: {error}") from None
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise MediaError("audio samples contain NaN or infinity")
    if audio.sample_rate != rate and len(samples) > 1:
        target = np.arange(round(seconds * rate)) / rate
        times = np.arange(len(samples)) / audio.sample_rate
        samples = np.interp(target, times, samples).astype(np.float32)
    if len(samples) < 2:  # libmtmd asserts (aborts) on a single sample
        raise MediaError(f"the audio holds {len(samples)} samples at {rate} Hz; need at least 2")
    return np.ascontiguousarray(samples, dtype=np.float32)
