"""libmtmd handles: a multimodal projector bound to its text model, media bitmaps, and
tokenized multimodal prompts (input chunks), each freed once, children before parents."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from llamacrab._exceptions import (
    DecodeAbortedError,
    DecodeError,
    InvalidParameterError,
    MediaError,
    ModelLoadError,
    TokenizeError,
)
from llamacrab._field_types import INT32_MAX, INT32_MIN, check_range, file_path
from llamacrab._native import projector_probe
from llamacrab._native.batch import check_positions
from llamacrab._native.call import c_path, c_string, call, call_bounded, ffi, lib
from llamacrab._native.claims import Exclusive
from llamacrab._native.context import Context
from llamacrab._native.fork import note_compute_threads, thread_limit
from llamacrab._native.gguf import archs
from llamacrab._native.gguf.check import validate_gguf
from llamacrab._native.handle import NativeHandle
from llamacrab._native.host_limits import GGML_MAX_N_THREADS
from llamacrab._native.logging import log_lines
from llamacrab._native.media import (
    MAX_AUDIO_SECONDS,
    Image,
    Media,
    check_wav_format_chunks,
    pcm_for_rate,
    rgb_pixels,
    sniff,
)
from llamacrab._native.model import Model
from llamacrab._native.pretokenizer import run_bounded
from llamacrab._native.signals import held_signals

# llamacrab's libmtmd polls an abort callback while it encodes (llamacrab-sys's patches); a
# llama.cpp a user brought may not, and its encodes then run to their end.
_ENCODER_ABORTS = hasattr(lib, "safe_mtmd_set_abort_callback")


def embeddings_refusal(arch: str, rope_type: int, encoder_decoder: bool = False) -> str | None:
    """Why a text model of ``arch`` with ``rope_type`` (llama_model_rope_type), an
    ``encoder_decoder`` one or not, cannot decode a projector's embeddings (its graph aborts
    on them), or None when it can."""
    if encoder_decoder:
        return (
            "libmtmd decodes a prompt into an encoder-decoder model's decoder without running "
            "its encoder, and llama.cpp aborts on that"
        )
    if arch in archs.TOKENS_ONLY:
        return f"llama.cpp's {arch} graph takes token ids only (it aborts on embeddings)"
    if arch in archs.EMBEDDINGS_NEED_MROPE and rope_type != lib.LLAMA_ROPE_TYPE_MROPE:
        return (
            f"this {arch} file has no M-RoPE (its rope.dimension_sections need the first two "
            "> 0), and llama.cpp aborts on embeddings without it"
        )
    return None


class Projector(NativeHandle):
    """A multimodal projector (an ``mmproj`` GGUF) for ``model``: it turns images or audio into
    embeddings the text model reads. Closing the model closes it first."""

    kind = "multimodal projector"

    def __init__(
        self,
        model: Model,
        path: str | os.PathLike[str],
        n_threads: int | None = None,
        use_gpu: bool = True,
        probe: bool = True,
    ) -> None:
        """``n_threads``: 1..512 (None: libmtmd's default). ``probe``: load the file in a child
        process first, and refuse it if that dies (``projector_probe``: libmtmd cannot tell a
        file whose tensors disagree with its description, and aborts on it); False saves that
        second load for trusted files."""
        if not hasattr(lib, "mtmd_init_from_file"):
            # A llama.cpp a user brought may come without libmtmd (build_info()).
            raise ModelLoadError(
                "this llamacrab-sys was built against a llama.cpp without libmtmd "
                "(multimodal): rebuild that llama.cpp with its tools to load a projector"
            )
        file = file_path("the projector path", path)
        check_range("n_threads", n_threads, 1, GGML_MAX_N_THREADS)  # each encode starts them
        with model.in_flight() as model_pointer:
            rope_type = int(lib.llama_model_rope_type(model_pointer))
        refusal = embeddings_refusal(model.arch, rope_type, model.encoder_decoder)
        if refusal is not None:
            raise MediaError(f"{model.path.name} cannot take images or audio: {refusal}")
        validate_gguf(file, kind="projector")
        if probe:
            projector_probe.probe(model.path, file)
        params = lib.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = thread_limit(params.n_threads if n_threads is None else n_threads)
        note_compute_threads()
        log_lines.take_errors()
        self._encoder_busy = Exclusive()
        self._evaluating: Context | None = None  # the context an evaluate() in flight polls
        # Closing the model from another thread waits for the load, then closes this too;
        # signals wait for the handle (signals.py).
        with held_signals(), model.in_flight() as model_pointer:
            pointer = call("mtmd_init_from_file", c_path(file, "projector path"), model_pointer,
                           params)  # fmt: skip
            if pointer == ffi.NULL:
                reason = log_lines.take_errors() or "see the llamacrab logger"
                raise ModelLoadError(f"libmtmd could not load the projector {file.name}: {reason}")
            super().__init__(pointer, lib.mtmd_free, model)
            with self.in_flight():
                self.vision = bool(lib.mtmd_support_vision(pointer))
                self.audio = bool(lib.mtmd_support_audio(pointer))
                rate = int(lib.mtmd_get_audio_sample_rate(pointer))
                self.uses_mrope = bool(lib.mtmd_decode_use_mrope(pointer))
        self.model, self.path = model, file
        self.sample_rate = rate if rate > 0 else None
        self.marker: str = ffi.string(lib.mtmd_default_marker()).decode()

    def bitmap(self, media: Media) -> Bitmap:
        """The bitmap of an image or a sound, decoded and checked against this projector."""
        kind = "image" if isinstance(media, Image) else "audio"
        if not (self.vision if kind == "image" else self.audio):
            raise MediaError(f"{self.path.name} has no {kind} encoder: it cannot take {kind}")
        if media.data is not None and sniff(media.data) != kind:
            raise MediaError(f"the bytes given as {kind} hold {sniff(media.data)}")
        if isinstance(media, Image):
            pixels = rgb_pixels(media)
            height, width = pixels.shape[:2]
            data = ffi.from_buffer("unsigned char[]", pixels)
            with held_signals():  # nothing lands between the bitmap and its handle
                return Bitmap(self, call("mtmd_bitmap_init", width, height, data))
        if media.data is not None:
            return self._decoded_audio(media.data)
        assert self.sample_rate is not None
        samples = ffi.from_buffer("float[]", pcm_for_rate(media, self.sample_rate))
        with held_signals():
            return Bitmap(self, call("mtmd_bitmap_init_from_audio", len(samples), samples))

    def _decoded_audio(self, data: bytes) -> Bitmap:
        """A sound file decoded (and resampled) by libmtmd; ``sniff`` made sure it is audio, so
        libmtmd takes its audio path and never its video fallback (which runs ffprobe)."""
        check_wav_format_chunks(data)
        log_lines.take_errors()
        # Patched libmtmd refuses a file decoding to more than MAX_AUDIO_SECONDS before it
        # allocates the samples (a few kB can declare hours; llamacrab-sys's patches).
        with held_signals(), self.in_flight() as projector:
            wrapper = call_bounded("mtmd_helper_bitmap_init_from_buf", projector,
                                   ffi.from_buffer("unsigned char[]", data), len(data), False,
                                   lib.mtmd_helper_init_opt_default(),
                                   refusal=MediaError)  # fmt: skip
            if wrapper.bitmap == ffi.NULL:
                reason = log_lines.take_errors() or "unrecognized format"
                raise MediaError(f"could not decode the audio ({len(data)} bytes): {reason}")
            bitmap = Bitmap(self, wrapper.bitmap)
        # libmtmd asserts (aborts) on audio of a single sample.
        if lib.mtmd_bitmap_get_n_bytes(wrapper.bitmap) < 2 * 4:
            bitmap.close()
            raise MediaError("the audio holds fewer than 2 samples")
        return bitmap

    def silence_tokens(self, n_samples: int) -> int:
        """The embeddings ``n_samples`` of sound become, counted on silence: the count depends
        on the length alone. libmtmd still computes the spectrogram (~3.5 ms per second of
        sound on one core), in one call nothing interrupts. At most MAX_AUDIO_SECONDS: libmtmd
        zero-fills the samples first."""
        if self.sample_rate is None:
            raise MediaError(f"{self.path.name} has no audio encoder: it cannot take audio")
        check_range("n_samples", n_samples, 1, MAX_AUDIO_SECONDS * self.sample_rate)
        with held_signals():  # no data: libmtmd makes the silence (a placeholder bitmap)
            bitmap = Bitmap(self, call("mtmd_bitmap_init_from_audio", n_samples, ffi.NULL))
        try:
            chunks = self.tokenize(f"{self.marker} .", [bitmap])
        finally:
            bitmap.close()
        try:
            return int(chunks.media_tokens().sum())
        finally:
            chunks.close()

    def tokenize(
        self,
        text: str,
        bitmaps: Sequence[Bitmap],
        add_special: bool = True,
        parse_special: bool = False,
    ) -> Chunks:
        """Text with one ``marker`` per bitmap, in order, as input chunks."""
        markers = text.count(self.marker)
        if markers != len(bitmaps):
            raise MediaError(
                f"the prompt has {markers} media markers ({self.marker}) for {len(bitmaps)} "
                "images/sounds: they must match one to one"
            )
        encoded = c_string(text, "prompt")
        chunks = Chunks(self)
        # The text's C copy is made by the call itself, where it lives as long as the call: a
        # Ctrl-C that ends run_bounded's wait unwinds this frame while its thread reads on.
        fill = partial(self._tokenize_into, chunks, encoded, add_special, parse_special, bitmaps)
        try:  # libmtmd tokenizes the text with llama.cpp's tokenizer (pretokenizer.py)
            status = run_bounded(text, fill) if self.model.vocab.regex_may_recurse else fill()
        except TokenizeError:
            chunks.close()
            raise
        if status != 0:
            chunks.close()
            reason = log_lines.take_errors() or f"status {status}"
            raise MediaError(f"libmtmd could not tokenize the multimodal prompt: {reason}")
        media_tokens = chunks.media_tokens()
        if media_tokens.size == 0:
            chunks.close()
            raise MediaError("the prompt is empty: it tokenized to nothing to evaluate")
        if media_tokens[-1]:
            # An image's embeddings yield no logits: sampling after one would abort.
            chunks.close()
            raise MediaError("end the prompt with text after the last image or sound")
        return chunks

    def _tokenize_into(
        self,
        chunks: Chunks,
        encoded: bytes,
        add_special: bool,
        parse_special: bool,
        bitmaps: Sequence[Bitmap],
    ) -> int:
        text_buffer = ffi.new("char[]", encoded)
        text = ffi.new("mtmd_input_text *")
        text.text, text.text_len = text_buffer, len(encoded)
        text.add_special, text.parse_special = add_special, parse_special
        # Everything it reads stays open until it returns: closing the model from another
        # thread (the projector and its bitmaps first) waits for this call.
        with ExitStack() as pinned:
            projector = pinned.enter_context(self.in_flight())
            chunk_list = pinned.enter_context(chunks.in_flight())
            bitmap_pointers = [pinned.enter_context(b.in_flight()) for b in bitmaps]
            pointers = ffi.new("mtmd_bitmap *[]", bitmap_pointers or [ffi.NULL])
            log_lines.take_errors()
            return int(call("mtmd_tokenize", projector, chunk_list, text, pointers,
                            len(bitmaps)))  # fmt: skip

    def evaluate(
        self,
        context: Context,
        chunks: Chunks,
        n_past: int,
        seq_id: int,
        stopped: Callable[[], bool] | None = None,
    ) -> int:
        """Decode ``chunks`` into ``seq_id`` from position ``n_past`` (images and audio are
        encoded first); the logits of the last token are kept. Returns the next position.
        ``context.cancel()``, closing either, or a Ctrl-C stops it (DecodeAbortedError), in
        the middle of an image's encoding too; so does ``stopped`` returning True at the
        start (a cancel that came just before). One evaluation at a time per projector."""
        # libmtmd sizes embeddings by this projector's model and its chunks' tokens: another
        # model's context, or chunks of another projector, read past the end of its buffers.
        if chunks.projector is not self:
            raise MediaError("these chunks were tokenized by another projector; tokenize the "
                             "prompt with the projector that evaluates it")  # fmt: skip
        if context.model is not self.model:
            raise MediaError("this projector was made for another model than the context's; "
                             "evaluate with a projector of the context's model")  # fmt: skip
        # libmtmd asserts on a sequence the context lacks (an abort) and places its tokens
        # from n_past without a check: they must fit 0..LAST_POSITION, as a Batch's do.
        context.check_sequence(seq_id)
        check_range("n_past", n_past, INT32_MIN, INT32_MAX)
        check_positions(n_past, n_past + max(chunks.n_pos, 1) - 1)
        new_n_past = ffi.new("llama_pos *")
        with (
            self.in_flight() as projector,
            chunks.in_flight() as chunk_list,
            context.exclusive() as pointer,
            ExitStack() as held,
        ):
            _check_micro_batch(self.path, projector, chunk_list, context.n_ubatch)
            held.enter_context(self._encoding_for(projector, context, stopped))
            context.hold_graph_samplers(pointer, held)
            # libmtmd turns causal attention off for a non-causal image, then on, whatever it
            # was: a non-causal context (an embedding model's) would stay causal for good.
            causal = bool(lib.llama_get_causal_attn(pointer))
            try:
                # Split by max_decode: a non-causal text model must not get more than n_ubatch.
                status = call("mtmd_helper_eval_chunks", projector, pointer, chunk_list,
                              n_past, seq_id, context.max_decode, True, new_n_past)  # fmt: skip
            finally:
                call("llama_set_causal_attn", pointer, causal)
            aborted = status != 0 and context.abort_requested()
        if aborted:
            raise DecodeAbortedError("the multimodal prompt's evaluation was cancelled", status)
        if status != 0:
            raise DecodeError(f"libmtmd could not evaluate the prompt (status {status})", status)
        return int(new_n_past[0])

    @contextmanager
    def _encoding_for(
        self, projector: Any, context: Context, stopped: Callable[[], bool] | None
    ) -> Iterator[None]:
        """Have the encoder poll ``context``'s abort flags (a patched libmtmd; the decodes
        poll them anyway) for one evaluation, armed; the projector's ``close()`` cancels it."""
        # libmtmd's encoder keeps one compute graph and one output buffer per projector.
        busy = "this projector is evaluating a prompt on another thread"
        with self._encoder_busy.hold(busy, busy):
            try:
                self._evaluating = context
                context.arm_cancel()  # clears a cancel from before: look at what asked for one
                if self._closing or (stopped is not None and stopped()):
                    context.cancel()
                if _ENCODER_ABORTS:
                    call("mtmd_set_abort_callback", projector, lib.llamacrab_abort_on_flags,
                         context.abort_flags)  # fmt: skip
                try:
                    yield
                finally:
                    if _ENCODER_ABORTS:  # the flags may be freed before the next evaluation
                        call("mtmd_set_abort_callback", projector, ffi.NULL, ffi.NULL)
            finally:
                self._evaluating = None

    def _interrupt(self) -> None:
        evaluating = self._evaluating
        if evaluating is not None:
            evaluating.cancel()


class Bitmap(NativeHandle):
    """One decoded image or sound, ready for ``Projector.tokenize``."""

    kind = "media bitmap"

    def __init__(self, projector: Projector, pointer: Any) -> None:
        if pointer == ffi.NULL:
            raise MediaError("libmtmd could not create the bitmap")
        super().__init__(pointer, lib.mtmd_bitmap_free, projector)

    @property
    def n_bytes(self) -> int:
        """Its data's size: 3 per pixel of an image, 4 per sample of a sound (float32)."""
        return self.read(lib.mtmd_bitmap_get_n_bytes)


class Chunks(NativeHandle):
    """A tokenized multimodal prompt: text tokens and media embeddings to decode in order."""

    kind = "multimodal prompt"

    def __init__(self, projector: Projector) -> None:
        with held_signals():  # nothing lands between the chunks and their handle
            pointer = call("mtmd_input_chunks_init")
            if pointer == ffi.NULL:
                raise MediaError("libmtmd could not allocate input chunks")
            super().__init__(pointer, lib.mtmd_input_chunks_free, projector)
        self.projector = projector

    @property
    def n_tokens(self) -> int:
        return self.read(lib.mtmd_helper_get_n_tokens)

    @property
    def n_pos(self) -> int:
        """Positions the prompt takes (differs from n_tokens with M-RoPE)."""
        return self.read(lib.mtmd_helper_get_n_pos)

    def text_tokens(self) -> list[int]:
        """The tokens of the text chunks, in order (an image or a sound has none)."""
        text, size = lib.MTMD_INPUT_CHUNK_TYPE_TEXT, ffi.new("size_t *")
        tokens: list[int] = []
        with self.in_flight() as chunk_list:
            for chunk in chunk_pointers(chunk_list):
                if lib.mtmd_input_chunk_get_type(chunk) == text:
                    data = lib.mtmd_input_chunk_get_tokens_text(chunk, size)
                    if size[0]:  # (ffi.unpack refuses a NULL even of no items)
                        tokens += ffi.unpack(data, size[0])
        return tokens

    def media_tokens(self) -> np.ndarray:
        """Per chunk: 0 for text, else the embeddings an image or sound became."""
        with self.in_flight() as chunk_list:
            return np.array(_media_tokens(chunk_list), dtype=np.int64)


def _check_micro_batch(path: Path, projector: Any, chunk_list: Any, n_ubatch: int) -> None:
    """Media this projector decodes with non-causal attention (Gemma 3 and Gemma 4 images,
    ...) must fit one micro-batch: llama_decode asserts n_ubatch >= n_tokens (an abort,
    llama-context.cpp:1787), and an image split over several decodes would not attend
    across its parts. Both pointers are held in flight by the caller."""
    for chunk, n_tokens in zip(chunk_pointers(chunk_list), _media_tokens(chunk_list), strict=True):
        if n_tokens > n_ubatch and lib.mtmd_decode_use_non_causal(projector, chunk):
            raise InvalidParameterError(
                f"{path.name} turns this image or sound into {n_tokens} tokens that "
                f"attend to each other (non-causal), so they must fit one micro-batch, but "
                f"n_ubatch is {n_ubatch}: raise it to at least {n_tokens}, e.g. "
                f"Llama(..., n_ubatch={n_tokens}) (and n_batch if smaller: it caps n_ubatch)"
            )


def chunk_pointers(chunk_list: Any) -> list[Any]:
    """The chunk pointers of an input chunk list held in flight (``Chunks.in_flight()``), in
    order; they are valid while it is."""
    count = int(lib.mtmd_input_chunks_size(chunk_list))
    return [lib.mtmd_input_chunks_get(chunk_list, i) for i in range(count)]


def _media_tokens(chunk_list: Any) -> list[int]:
    """Per chunk of a list held in flight: 0 for text, else the embeddings it became."""
    text = lib.MTMD_INPUT_CHUNK_TYPE_TEXT
    return [0 if lib.mtmd_input_chunk_get_type(chunk) == text
            else int(lib.mtmd_input_chunk_get_n_tokens(chunk))
            for chunk in chunk_pointers(chunk_list)]  # fmt: skip
