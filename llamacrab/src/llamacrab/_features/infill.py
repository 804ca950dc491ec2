"""Fill-in-the-middle prompts built from the vocabulary's FIM tokens.

Layout (as llama-server's /infill, repository-level pattern):

    [FIM_REP]repo\\n [FIM_SEP]name\\n text ... [FIM_SEP]current\\n
    [BOS] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]      (prefix-suffix-middle)
    [BOS] [FIM_SUF] suffix [FIM_PRE] prefix [FIM_MID]      (suffix-prefix-middle, spm=True)

Repository and file context appear only when the model has FIM_REP / FIM_SEP tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.vocab import Vocab


@dataclass(frozen=True)
class InfillLimits:
    """How many tokens of each part an infill prompt keeps: the end of the prefix (nearest the
    gap), the start of the suffix, the end of the repository context (the files listed last).
    None keeps a part whole."""

    prefix: int | None = None
    suffix: int | None = None
    context: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefix", "suffix", "context"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidParameterError(
                    f"InfillLimits.{name} must be >= 0 or None, not {value!r}"
                )

    @staticmethod
    def llama_server(n_batch: int, n_ctx_seq: int, n_prompt: int = 0) -> InfillLimits:
        """llama-server's /infill: prefix and suffix fit one batch, 3:1 (less the prompt that
        continues the prefix, and two FIM tokens); the context fills a sequence's share of
        the context less a batch (and two more tokens: its generation limit is -1)."""
        return InfillLimits(3 * (n_batch // 4), max(0, n_batch // 4 - (2 + n_prompt)),
                            max(0, n_ctx_seq - n_batch + 2))  # fmt: skip


def infill_tokens(
    vocab: Vocab,
    prefix: str,
    suffix: str,
    *,
    spm: bool = False,
    repo: str | None = None,
    files: Sequence[tuple[str, str]] = (),
    file_name: str | None = None,
    limits: InfillLimits = InfillLimits(),
) -> list[int]:
    """Tokens asking the model for the text between ``prefix`` and ``suffix``. ``files`` are
    (name, text) pairs of other files for context; ``file_name`` names the current one;
    ``limits`` cuts each part to its budget."""
    pre, suf, mid = vocab.fim_prefix, vocab.fim_suffix, vocab.fim_middle
    if pre is None or suf is None or mid is None:
        raise InvalidParameterError(
            "this model has no fill-in-the-middle tokens (FIM prefix/suffix/middle)"
        )
    context: list[int] = []
    if repo is not None and vocab.fim_repo is not None:
        context += [vocab.fim_repo, *vocab.tokenize(repo + "\n", add_special=False)]
    for name, text in files:
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidParameterError(
                f"files must be (name, text) pairs of strings, not {(name, text)!r:.80}"
            )
    if vocab.fim_file_sep is not None:
        for name, text in files:
            context += [vocab.fim_file_sep, *vocab.tokenize(name + "\n", add_special=False)]
            context += vocab.tokenize(text, add_special=False)
        if file_name is not None or files:
            current = (file_name or "file") + "\n"
            context += [vocab.fim_file_sep, *vocab.tokenize(current, add_special=False)]
    elif files:
        raise InvalidParameterError("this model has no FIM file-separator token for files=")
    tokens = [vocab.bos] if vocab.add_bos and vocab.bos is not None else []
    tokens += _last(context, limits.context)
    before = [pre, *_last(vocab.tokenize(prefix, add_special=False), limits.prefix)]
    after = [suf, *vocab.tokenize(suffix, add_special=False)[: limits.suffix]]
    return tokens + (after + before if spm else before + after) + [mid]


def _last(tokens: list[int], count: int | None) -> list[int]:
    return tokens if count is None else tokens[max(0, len(tokens) - count) :]
