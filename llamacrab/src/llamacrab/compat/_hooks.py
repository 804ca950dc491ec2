"""Logits processors and stopping criteria in llama-cpp-python's form, run by llamacrab's
engine as a CustomSampler (first in the sampler chain, once per generated token)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from llamacrab import CustomSampler, EndGeneration

LogitsProcessor = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], npt.NDArray[np.single]]
StoppingCriteria = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], bool]


class LogitsProcessorList(list[LogitsProcessor]):
    """Processors applied in order: each gets the token ids so far (prompt and output) and the
    scores (logits over the whole vocabulary, by token id) and returns the new scores."""

    def __call__(
        self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]
    ) -> npt.NDArray[np.single]:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list[StoppingCriteria]):
    """Stops the generation when any criterion returns True for the token ids so far and the
    logits of the token about to be sampled (which is then not output)."""

    def __call__(self, input_ids: npt.NDArray[np.intc], logits: npt.NDArray[np.single]) -> bool:
        return any([criterion(input_ids, logits) for criterion in self])


class MinTokensLogitsProcessor:
    """Forbids ``token_eos`` until ``min_tokens`` tokens have been generated. (llamacrab's own
    ``min_tokens=`` option does this in C for every end-of-generation token.)"""

    def __init__(self, min_tokens: int, token_eos: int) -> None:
        self.min_tokens = min_tokens
        self.token_eos = token_eos
        self.prompt_tokens: int | None = None

    def __call__(
        self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]
    ) -> npt.NDArray[np.single]:
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        if len(input_ids) - self.prompt_tokens < self.min_tokens:
            scores[self.token_eos] = -np.inf
        return scores


class Hooks(CustomSampler):
    """One generation's processors and criteria. They see copies (never llama.cpp's buffer),
    in token-id order; processors' scores are written back. When a criterion fires, the
    engine ends the generation there (EndGeneration: the token is not emitted, finish_reason
    "stop"); an exception in either reaches the caller."""

    name = "logits_processor"  # as errors about the logits it wrote name it

    def __init__(
        self,
        prompt: Sequence[int],
        processors: LogitsProcessor | None,
        criteria: StoppingCriteria | None,
        n_vocab: int,
    ) -> None:
        self.ids = list(prompt)
        self.n_prompt = len(self.ids)
        self.processors = processors
        self.criteria = criteria
        self.n_vocab = n_vocab

    def apply(self, candidates: np.ndarray) -> None:
        # An exception here reaches the caller: the engine raises it once llama.cpp returns.
        ids = candidates["id"]
        logits = candidates["logit"]
        in_order = ids.size == self.n_vocab and ids[0] == 0 and ids[-1] == self.n_vocab - 1
        if in_order:
            raw = logits.copy()
        else:  # not expected (custom samplers run first), but never index blindly
            raw = np.full(self.n_vocab, -np.inf, dtype=np.single)
            raw[ids] = logits
        input_ids = np.asarray(self.ids, dtype=np.intc)
        if self.processors is not None:
            returned = self.processors(input_ids, raw.copy())
            try:
                scores = np.asarray(returned, dtype=np.single)
            except (TypeError, ValueError):
                raise ValueError(
                    f"a logits processor returned {type(returned).__name__}, not an array of "
                    f"{self.n_vocab} scores"
                ) from None
            if scores.shape != (self.n_vocab,):
                raise ValueError(
                    f"a logits processor returned shape {scores.shape}, not ({self.n_vocab},)"
                )
            logits[:] = scores if in_order else scores[ids]
        if self.criteria is not None and self.criteria(input_ids, raw):
            raise EndGeneration

    def accept(self, token: int) -> None:
        self.ids.append(token)

    def reset(self) -> None:
        del self.ids[self.n_prompt :]
