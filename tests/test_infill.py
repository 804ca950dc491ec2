"""Fill-in-the-middle: token layout from the vocabulary's FIM tokens, generation and streaming."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_crash_proof import assert_clean_exit, run_child

from llamacrab import (
    InfillLimits,
    InvalidParameterError,
    Llama,
    SamplerChain,
    SamplingOptions,
)

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")


@pytest.fixture(scope="module")
def fim_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    path = tiny.write_tiny_llama(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf", fim=True)
    with Llama(path, n_ctx=128, n_threads=2) as llm:
        yield llm


def ids(llm: Llama) -> dict[str, int]:
    return {name: llm.vocab.tokenize(name, add_special=False, parse_special=True)[0]
            for name in tiny.FIM_TOKENS}  # fmt: skip


def text(llm: Llama, value: str) -> list[int]:
    return llm.vocab.tokenize(value, add_special=False)


def test_prefix_suffix_middle_layout(fim_llama: Llama) -> None:
    from llamacrab._features.infill import infill_tokens

    t = ids(fim_llama)
    vocab = fim_llama.vocab
    assert (vocab.fim_prefix, vocab.fim_suffix, vocab.fim_middle) == (
        t["<|fim_prefix|>"], t["<|fim_suffix|>"], t["<|fim_middle|>"])  # fmt: skip
    cat, mat = text(fim_llama, "the cat"), text(fim_llama, "the mat")
    pre, suf, mid = t["<|fim_prefix|>"], t["<|fim_suffix|>"], t["<|fim_middle|>"]
    psm = infill_tokens(vocab, "the cat", "the mat")
    assert psm == [vocab.bos, pre, *cat, suf, *mat, mid]
    spm = infill_tokens(vocab, "the cat", "the mat", spm=True)
    assert spm == [vocab.bos, suf, *mat, pre, *cat, mid]
    repo = infill_tokens(vocab, "a", "b", repo="crab", files=[("x.py", "the dog")],
                         file_name="y.py")  # fmt: skip
    assert repo[:2] == [vocab.bos, t["<|repo_name|>"]]
    assert repo.count(t["<|file_sep|>"]) == 2
    assert repo[-len(psm_tail(fim_llama, "a", "b")) :] == psm_tail(fim_llama, "a", "b")


def psm_tail(llm: Llama, prefix: str, suffix: str) -> list[int]:
    t = ids(llm)
    return [t["<|fim_prefix|>"], *text(llm, prefix), t["<|fim_suffix|>"], *text(llm, suffix),
            t["<|fim_middle|>"]]  # fmt: skip


def test_infill_generates_and_streams(fim_llama: Llama) -> None:
    from llamacrab._features.infill import infill_tokens

    result = fim_llama.create_infill("the cat", "on the mat", max_tokens=4, temperature=0)
    expected = infill_tokens(fim_llama.vocab, "the cat", "on the mat")
    assert result.usage.prompt_tokens == len(expected)
    chunks = list(fim_llama.stream_infill("the cat", "on the mat", max_tokens=4, temperature=0))
    assert "".join(c.text for c in chunks) == result.text
    assert chunks[-1].finish_reason == result.choices[0].finish_reason


def test_model_without_fim_tokens(tiny_llama: Llama) -> None:
    with pytest.raises(InvalidParameterError, match="fill-in-the-middle"):
        tiny_llama.create_infill("a", "b")


def test_limits_keep_the_text_nearest_the_gap(fim_llama: Llama) -> None:
    t = ids(fim_llama)
    pre, suf, mid = t["<|fim_prefix|>"], t["<|fim_suffix|>"], t["<|fim_middle|>"]
    prefix, suffix = "one two three four five six", "seven eight nine ten"
    files = [("a.py", "alpha beta gamma"), ("b.py", "delta epsilon")]
    whole = fim_llama.infill_prompt(prefix, suffix, repo="crab", files=files, file_name="c.py")
    limits = InfillLimits(prefix=5, suffix=3, context=7)
    cut = fim_llama.infill_prompt(prefix, suffix, repo="crab", files=files, file_name="c.py",
                                  limits=limits)  # fmt: skip
    bos = fim_llama.vocab.bos
    context = whole[1 : whole.index(pre)]  # after BOS: the repository and its files
    assert cut == [bos, *context[-7:], pre, *text(fim_llama, prefix)[-5:], suf,
                   *text(fim_llama, suffix)[:3], mid]  # fmt: skip
    assert fim_llama.infill_prompt(prefix, suffix, limits=InfillLimits(0, 0, 0)) == [
        bos, pre, suf, mid]  # fmt: skip
    # llama-server's budgets: a batch for prefix and suffix (3:1, less the prompt and two FIM
    # tokens), the rest of a sequence's context for the repository (its limit of -1 adds 2).
    assert InfillLimits.llama_server(2048, 4096, n_prompt=10) == InfillLimits(1536, 500, 2050)
    assert InfillLimits.llama_server(512, 256) == InfillLimits(384, 126, 0)
    for bad in (-1, 1.5):
        with pytest.raises(InvalidParameterError, match=r"InfillLimits\.suffix"):
            InfillLimits(suffix=bad)  # type: ignore[arg-type]


# argv[1]: a model with FIM tokens but neither an EOS nor an EOT token.
_NO_END_TOKEN = """
    import sys
    from fastapi.testclient import TestClient
    from llamacrab import InvalidParameterError, Llama
    from llamacrab.server import ServerSettings
    from llamacrab.server._app import create_app

    llm = Llama(sys.argv[1], n_ctx=128, n_threads=2)
    assert llm.vocab.eos is None and llm.vocab.eot is None
    expected = llm.create_completion([5, 6, 7], max_tokens=4, seed=1).choices[0].tokens
    for infill in (lambda: llm.create_completion([5, 6, 7], max_tokens=4, infill=True),
                   lambda: list(llm.stream_infill("the", "cat", max_tokens=4, infill=True))):
        try:
            infill()
        except InvalidParameterError as error:
            print("refused:", error)
    with TestClient(create_app(ServerSettings(model=sys.argv[1]), llm)) as client:
        # llama-server's samplers: "infill" (or "i") adds the infill sampler to the chain.
        for path, body in (("/completion", {"prompt": "the", "samplers": "kit"}),
                           ("/infill", {"input_prefix": "the", "input_suffix": "cat",
                                        "samplers": ["top_k", "infill", "temperature"]})):
            answer = client.post(path, json={**body, "n_predict": 4})
            print("served:", answer.status_code, answer.json()["error"]["message"])
    assert llm.create_completion([5, 6, 7], max_tokens=4, seed=1).choices[0].tokens == expected
    print("done")
"""


def test_infill_sampling_needs_an_end_token(tmp_path: Path) -> None:
    """llama.cpp's infill sampler puts in EOT (or EOS) when no text token is likely enough,
    and asserts the model has one: infill=True on a model without either aborted the process.
    It is refused before llama.cpp runs, on the server's /completion and /infill too."""
    path = tiny.write_tiny_llama(tmp_path / "no-end.gguf", fim=True, no_end_tokens=True)
    child = run_child(_NO_END_TOKEN, str(path))
    assert_clean_exit(child)
    needs = (
        "infill sampling needs an end-of-text (EOT) or end-of-sequence (EOS) token; this model "
        "has neither"
    )
    lines = child.stdout.splitlines()
    assert [line.startswith(f"refused: {needs}") for line in lines[:2]] == [True, True], lines
    assert [line.startswith(f"served: 400 {needs}") for line in lines[2:4]] == [True] * 2, lines
    assert lines[4:] == ["done"], lines


def test_an_infill_chain_built_directly_needs_an_end_token(tmp_path: Path) -> None:
    """The public SamplerChain, without the completion's check: its pick would abort."""
    path = tiny.write_tiny_llama(tmp_path / "no-end.gguf", fim=True, no_end_tokens=True)
    with Llama(path, n_ctx=128, n_threads=2) as llm:
        with pytest.raises(InvalidParameterError, match="infill sampling needs an end-of-text"):
            SamplerChain(llm.model, SamplingOptions(infill=True, temperature=0.8))
        SamplerChain(llm.model, SamplingOptions(temperature=0.8)).close()  # still usable
