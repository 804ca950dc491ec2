"""Embeddings: many texts packed into each decode as separate sequences, pooled by llama.cpp.

Texts are packed in order while a decode holds at most ``pack_tokens`` tokens and n_seq_max
sequences; a longer text gets a decode of its own, up to n_ubatch tokens (non-causal models must
see a whole sequence in one ubatch, or llama.cpp aborts). Attention over a pack grows with the
square of its size, so a modest pack (default 256 tokens) is faster than one huge batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np

from llamacrab._engine.generation import KvState
from llamacrab._exceptions import ContextOverflowError, InvalidParameterError
from llamacrab._native.batch import Batch
from llamacrab._native.context import Context
from llamacrab._native.model import Model
from llamacrab._types import Classification, RerankResult

DEFAULT_PACK_TOKENS = 256
# Architectures whose rank pooling llama.cpp's graph ends with a softmax (llama-graph.cpp):
# their classifier outputs are probabilities already.
SOFTMAX_HEADS = frozenset({"qwen3", "qwen3vl"})


class Embedder:
    """Computes embeddings with one context created with ``embeddings=True``."""

    def __init__(self, context: Context, pack_tokens: int = DEFAULT_PACK_TOKENS) -> None:
        if not context.params.embeddings:
            raise InvalidParameterError("embeddings need a context created with embeddings=True")
        self.context = context
        pooling = context.pooling
        self.pooled = pooling != "none"
        self.ranks = pooling == "rank"
        model = context.model
        # Rank pooling yields the classifier's outputs (one score for a reranker) per sequence.
        self.width = model.n_cls_out if self.ranks else model.n_embd_out
        self.limit = min(context.n_ubatch, context.n_batch)  # one text, one decode
        # A learned position table (BERT) holds a text's positions too: past it, an abort.
        self.positions = model.position_rows
        if self.positions is not None:
            self.limit = min(self.limit, self.positions)
        if pack_tokens < 1:  # 0 or less was taken as 1: one text per decode, silently
            raise InvalidParameterError(
                f"pack_tokens (the tokens packed into one decode) must be at least 1, "
                f"not {pack_tokens}"
            )
        self.pack_tokens = min(pack_tokens, self.limit)
        self.n_seq = context.params.n_seq_max
        self.batch = Batch(self.limit, self.n_seq)

    def fit(self, tokens: list[int], index: int, truncate: bool) -> list[int]:
        """One text's tokens, cut to a single decode if ``truncate`` (keeping its last token,
        the separator a BERT-style model expects); otherwise too long is an error. No tokens
        is an error too: a decode of none gives no row."""
        if not tokens:
            raise InvalidParameterError(
                f"input {index} has no tokens to embed: an empty text (or list of token ids), "
                "to which the model adds no token of its own"
            )
        if len(tokens) <= self.limit:
            return tokens
        if not truncate:
            holds = ("the model's position table holds" if self.limit == self.positions
                     else "one decode holds")  # fmt: skip
            advice = "" if self.limit == self.positions else ", or raise n_ubatch"
            raise ContextOverflowError(
                f"text {index} has {len(tokens)} tokens; {holds} {self.limit} "
                f"(pass truncate=True{advice})",
                n_prompt_tokens=len(tokens), n_ctx=self.limit,
            )  # fmt: skip
        return tokens[: self.limit - 1] + tokens[-1:]

    def packs(self, texts: Sequence[list[int]]) -> Iterator[list[int]]:
        """Indices of texts decoded together."""
        pack: list[int] = []
        used = 0
        for i, tokens in enumerate(texts):
            if pack and (used + len(tokens) > self.pack_tokens or len(pack) == self.n_seq):
                yield pack
                pack, used = [], 0
            pack.append(i)
            used += len(tokens)
        if pack:
            yield pack

    def run(self, texts: Sequence[list[int]]) -> list[np.ndarray]:
        """Pooled: one (n_embd,) vector per text. Not pooled: (n_tokens, n_embd) per text."""
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(texts)
        for pack in self.packs(texts):
            sequences = [np.asarray(texts[i], dtype=np.int32) for i in pack]
            self.context.clear()
            self.batch.set_sequences(sequences)
            self.context.decode(self.batch)
            for seq_id, (i, tokens) in enumerate(zip(pack, sequences, strict=True)):
                out[i] = self._read(seq_id, tokens, sequences[:seq_id])
        return out

    def _read(self, seq_id: int, tokens: np.ndarray, before: list[np.ndarray]) -> np.ndarray:
        if self.pooled:
            pooled: np.ndarray = self.context.embeddings(self.width, seq_id=seq_id)[0]
            return pooled
        start = sum(len(t) for t in before)
        return self.context.embeddings(self.width, index=start, count=len(tokens))


def rerank_tokens(model: Model, query: str, document: str) -> list[int]:
    """A query/document pair as the model wants it: its ``rerank`` template from GGUF if any,
    else BOS query [EOS] [SEP] document [EOS] by the vocabulary's flags (as llama-server does)."""
    template = model.chat_template("rerank")
    vocab = model.vocab
    if template is not None:
        prompt = template.replace("{query}", query).replace("{document}", document)
        return vocab.tokenize(prompt, add_special=False, parse_special=True)
    end = vocab.eos if vocab.eos is not None else vocab.sep
    tokens = [vocab.bos] if vocab.add_bos and vocab.bos is not None else []
    tokens += vocab.tokenize(query, add_special=False)
    if vocab.add_eos and end is not None:
        tokens.append(end)
    if vocab.add_sep and vocab.sep is not None:
        tokens.append(vocab.sep)
    tokens += vocab.tokenize(document, add_special=False)
    if vocab.add_eos and end is not None:
        tokens.append(end)
    return tokens


def _classified_tokens(model: Model, item: str | tuple[str, str], index: int) -> list[int]:
    """A text's tokens, or a pair's (premise and hypothesis, query and document) laid out as
    a reranker's query and document (``Llama.classify`` checked the pair's length)."""
    if isinstance(item, str):
        return model.vocab.tokenize(item)
    if not all(isinstance(text, str) for text in item):
        raise InvalidParameterError(f"text {index} to classify is a pair of {item!r}: two str")
    return rerank_tokens(model, *item)


def _classification(
    index: int, labels: tuple[str, ...], row: np.ndarray, softmaxed: bool
) -> Classification:
    scores = row.astype(np.float64)
    if softmaxed:
        probabilities = scores
    elif len(scores) == 1:
        probabilities = 1 / (1 + np.exp(-scores))
    else:
        shifted = np.exp(scores - scores.max())
        probabilities = shifted / shifted.sum()
    order = sorted(range(len(scores)), key=lambda i: -probabilities[i])
    return Classification(
        index,
        tuple(labels[i] for i in order),
        tuple(float(scores[i]) for i in order),
        tuple(float(probabilities[i]) for i in order),
    )


def pool_tokens(vectors: np.ndarray, pooling: str) -> np.ndarray:
    """Pool one text's token vectors (n_tokens, n_embd) as llama.cpp would."""
    if pooling == "mean":
        pooled: np.ndarray = vectors.mean(axis=0)
    elif pooling == "cls":
        pooled = vectors[0]
    elif pooling == "last":
        pooled = vectors[-1]
    else:
        raise InvalidParameterError(f"pooling must be mean, cls or last here, not {pooling!r}")
    return pooled


def normalized(vectors: np.ndarray) -> np.ndarray:
    """L2-normalize along the last axis (zero vectors stay zero)."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    result: np.ndarray = vectors / np.where(norms == 0, 1, norms)
    return result


class Embeddings:
    """Embedding and reranking requests on a Llama's context, serialized by its ``lock``; they
    reuse the memory that ``kv`` caches prompts in."""

    def __init__(self, kv: KvState, lock: threading.RLock) -> None:
        self.context, self.kv, self.lock = kv.context, kv, lock
        self._embedder: Embedder | None = None

    def embedder(self, pack_tokens: int = DEFAULT_PACK_TOKENS) -> Embedder:
        embedder = self._embedder
        if embedder is None or embedder.pack_tokens != min(pack_tokens, embedder.limit):
            embedder = self._embedder = Embedder(self.context, pack_tokens)
        return embedder

    def embed(
        self,
        texts: str | Sequence[str | Sequence[int]],
        normalize: bool,
        truncate: bool,
        pooling: str | None,
        pack_tokens: int,
    ) -> np.ndarray | list[np.ndarray]:
        native = self.embedder(pack_tokens).pooled
        if pooling is not None and native:
            raise InvalidParameterError(
                f"pooling={pooling!r} per call needs a Llama created with pooling='none'; "
                "this context already pools"
            )
        if pooling is None and not native:
            return self.embed_tokens(texts, normalize, truncate)
        vectors = self._run(texts, truncate, pack_tokens)
        if pooling is not None:
            vectors = [pool_tokens(v, pooling) for v in vectors]
        model = self.context.model
        array = np.stack(vectors) if vectors else np.empty((0, model.n_embd), np.float32)
        return normalized(array) if normalize else array

    def embed_tokens(
        self, texts: str | Sequence[str | Sequence[int]], normalize: bool, truncate: bool
    ) -> list[np.ndarray]:
        if self.embedder().pooled:
            raise InvalidParameterError('token embeddings need a context with pooling="none"')
        vectors = self._run(texts, truncate, DEFAULT_PACK_TOKENS)
        return [normalized(v) if normalize else v for v in vectors]

    def rerank(
        self, query: str, documents: Sequence[str], top_n: int | None, truncate: bool
    ) -> list[RerankResult]:
        if top_n is not None and top_n < 0:
            raise InvalidParameterError(f"top_n must be >= 0, not {top_n}")
        model = self.context.model
        with self.lock:
            embedder = self.embedder()
            if not embedder.ranks:
                raise InvalidParameterError('reranking needs a context with pooling="rank"')
            pairs = [
                embedder.fit(rerank_tokens(model, query, doc), i, truncate)
                for i, doc in enumerate(documents)
            ]
            self.kv.lend()
            scores = [float(s[0]) for s in embedder.run(pairs)]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return [RerankResult(i, scores[i], documents[i]) for i in order]

    def classify(
        self, texts: str | Sequence[str | tuple[str, str]], truncate: bool
    ) -> list[Classification]:
        model = self.context.model
        if not self.embedder().ranks:
            raise InvalidParameterError(
                'classification needs a context with pooling="rank" (a sequence classifier '
                "or reranker: the model's own pooling, or Llama(..., pooling='rank'))"
            )
        items = [texts] if isinstance(texts, str) else list(texts)
        tokens = [_classified_tokens(model, item, i) for i, item in enumerate(items)]
        rows = self._run(tokens, truncate, DEFAULT_PACK_TOKENS)
        labels = model.classifier_labels
        softmaxed = model.arch in SOFTMAX_HEADS
        return [_classification(i, labels, row, softmaxed) for i, row in enumerate(rows)]

    def _run(
        self, texts: str | Sequence[str | Sequence[int]], truncate: bool, pack_tokens: int
    ) -> list[np.ndarray]:
        """Each item is a text, or token ids (checked against the vocabulary, used as given)."""
        items = [texts] if isinstance(texts, str) else list(texts)
        vocab = self.context.model.vocab

        def tokens_of(item: str | Sequence[int]) -> list[int]:
            if isinstance(item, str):
                return vocab.tokenize(item)
            return [int(t) for t in vocab.check_tokens(item)]

        with self.lock:
            embedder = self.embedder(pack_tokens)
            tokens = [embedder.fit(tokens_of(t), i, truncate) for i, t in enumerate(items)]
            self.kv.lend()
            return embedder.run(tokens)
