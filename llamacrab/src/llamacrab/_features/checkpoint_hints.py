"""Where a sliding-window or recurrent model keeps a checkpoint inside a text prompt: the
points a later prompt is likely to leave this one at, so that it resumes there instead of a
whole window earlier (or, recurrent, from the start). A chat's last message starts one; a
completion's last sentence (or line) another: a new question after the same document."""

from __future__ import annotations

import re
from collections.abc import Sequence

from llamacrab._native.vocab import Vocab

# A sentence ends at its mark before whitespace (CJK full stops need none); a line at its
# newline. The next one starts right after, its leading space included (tokenizers attach it
# to the word that follows).
_SENTENCE_END = re.compile(r"[.!?](?=\s)|[\u3002\uff01\uff1f]|\n")


def suffix_start(
    vocab: Vocab, text: str, tokens: Sequence[int], where: int, parse_special: bool
) -> int | None:
    """How many of ``tokens`` (``text`` tokenized) precede ``text[where:]``: where the prompt's
    tokens end with that suffix's own tokens; None where the tokenizer joined it to what came
    before (or ``where`` is not inside the text). A suffix starting with a space is tried
    without it too: tokenizers that prefix text with one (SentencePiece's) give it back."""
    if not 0 < where < len(text):
        return None
    suffixes = [text[where:]] + ([text[where + 1 :]] if text[where] == " " else [])
    for suffix in suffixes:
        rest = vocab.tokenize(suffix, add_special=False, parse_special=parse_special)
        start = len(tokens) - len(rest)
        if start > 0 and list(tokens[start:]) == rest:
            return start
    return None


def last_sentence_start(vocab: Vocab, text: str, tokens: Sequence[int]) -> int | None:
    """The token position where the text's last sentence or line starts (trailing whitespace
    is not a sentence), for a prompt tokenized as completions do (no special-token parsing)."""
    ends = list(_SENTENCE_END.finditer(text.rstrip()))
    return suffix_start(vocab, text, tokens, ends[-1].end(), False) if ends else None
