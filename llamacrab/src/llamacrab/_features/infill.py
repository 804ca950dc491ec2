"""Fill-in-the-middle prompts built from the vocabulary's FIM tokens.

Layout (as llama-server's /infill, repository-level pattern):

    [FIM_REP]repo\\n [FIM_SEP]name\\n text ... [FIM_SEP]current\\n
    [BOS] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]      (prefix-suffix-middle)
    [BOS] [FIM_SUF] suffix [FIM_PRE] prefix [FIM_MID]      (suffix-prefix-middle, spm=True)

Repository and file context appear only when the model has FIM_REP / FIM_SEP tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.vocab import Vocab


def infill_tokens(
    vocab: Vocab,
    prefix: str,
    suffix: str,
    *,
    spm: bool = False,
    repo: str | None = None,
    files: Sequence[tuple[str, str]] = (),
    file_name: str | None = None,
) -> list[int]:
    """Tokens asking the model for the text between ``prefix`` and ``suffix``. ``files`` are
    (name, text) pairs of other files for context; ``file_name`` names the current one."""
    pre, suf, mid = vocab.fim_prefix, vocab.fim_suffix, vocab.fim_middle
    if pre is None or suf is None or mid is None:
        raise InvalidParameterError(
            "this model has no fill-in-the-middle tokens (FIM prefix/suffix/middle)"
        )
    tokens = [vocab.bos] if vocab.add_bos and vocab.bos is not None else []
    if repo is not None and vocab.fim_repo is not None:
        tokens += [vocab.fim_repo, *vocab.tokenize(repo + "\n", add_special=False)]
    for name, text in files:
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidParameterError(
                f"files must be (name, text) pairs of strings, not {(name, text)!r:.80}"
            )
    if vocab.fim_file_sep is not None:
        for name, text in files:
            tokens += [vocab.fim_file_sep, *vocab.tokenize(name + "\n", add_special=False)]
            tokens += vocab.tokenize(text, add_special=False)
        if file_name is not None or files:
            current = (file_name or "file") + "\n"
            tokens += [vocab.fim_file_sep, *vocab.tokenize(current, add_special=False)]
    elif files:
        raise InvalidParameterError("this model has no FIM file-separator token for files=")
    before = [pre, *vocab.tokenize(prefix, add_special=False)]
    after = [suf, *vocab.tokenize(suffix, add_special=False)]
    return tokens + (after + before if spm else before + after) + [mid]
