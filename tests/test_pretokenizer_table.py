"""``SHALLOW_SPLIT_PRE``, re-derived from the llama.cpp source the build compiles: which
``tokenizer.ggml.pre`` name load() maps to which pre type (src/llama-vocab.cpp), which regexes
llm_tokenizer_bpe gives that type, and which of those never make std::regex recurse once per
character: unicode_regex_split_custom (src/unicode.cpp) splits them by hand, or each match is one
character. A bump that moves a listed name onto a deeper regex fails here, naming the change."""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

from llamacrab._native.pretokenizer import SHALLOW_SPLIT_PRE

SYS_DIR = Path(__file__).resolve().parents[1] / "llamacrab-sys"
if str(SYS_DIR) not in sys.path:
    sys.path.insert(0, str(SYS_DIR))  # build_tools: how the build finds the pinned source

REDERIVE = "re-derive SHALLOW_SPLIT_PRE by hand (docs/native-aborts.md says how)"

# C++ tokens: string and character literals, comments (dropped), words, operators.
_TOKEN = re.compile(
    r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/|\w+|\|\||==|\S', re.S
)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'"}


def _tokens(code: str) -> list[str]:
    return [token for token in _TOKEN.findall(code) if not token.startswith(("//", "/*"))]


def _string(token: str) -> str:
    assert token.startswith('"'), f"expected a string literal, found {token!r}: {REDERIVE}"
    escapes = set(re.findall(r"\\(.)", token[1:-1]))
    assert escapes <= _ESCAPES.keys(), f"unknown escapes {escapes} in {token}: {REDERIVE}"
    return re.sub(r"\\(.)", lambda escape: _ESCAPES[escape[1]], token[1:-1])


def _between(code: str, start: str, end: str) -> list[str]:
    """The tokens from ``start`` (included) to the next ``end`` (excluded)."""
    begin = code.index(start)
    return _tokens(code[begin : code.index(end, begin)])


def _closing(tokens: list[str], at: int) -> int:
    """The index of the bracket closing the one at ``at``."""
    pairs = {"(": ")", "{": "}"}
    depth = 0
    for index in range(at, len(tokens)):
        depth += tokens[index] == tokens[at]
        depth -= tokens[index] == pairs[tokens[at]]
        if depth == 0:
            return index
    raise AssertionError(f"unbalanced {tokens[at]!r}: {REDERIVE}")


def _disjunction(condition: list[str], subject: str) -> list[str]:
    """The strings of ``subject == "a" || subject == "b" ...``."""
    terms = [condition[at : at + 3] for at in range(0, len(condition), 4)]
    separators = condition[3::4]
    assert (
        len(condition) % 4 == 3
        and set(separators) <= {"||"}
        and all(term[:2] == [subject, "=="] and term[2].startswith('"') for term in terms)
    ), f'a condition other than {subject} == "..." || ...: {condition}: {REDERIVE}'
    return [_string(term[2]) for term in terms]


def _strings(listed: list[str]) -> list[str]:
    """The strings of ``"a", "b" "c",``: adjacent literals join, as in C++."""
    strings: list[list[str]] = [[]]
    for token in listed:
        if token == ",":
            strings.append([])
        else:
            strings[-1].append(_string(token))
    return ["".join(parts) for parts in strings if parts]


@cache
def _source() -> tuple[str, str]:
    from build_tools.source import resolve_source

    src = resolve_source().path / "src"
    return (
        (src / "llama-vocab.cpp").read_text(encoding="utf-8"),
        (src / "unicode.cpp").read_text(encoding="utf-8"),
    )


def hand_split_regexes(unicode_cpp: str) -> set[str]:
    """The regexes unicode_regex_split_custom compares against: those never reach std::regex."""
    tokens = _between(unicode_cpp, "unicode_regex_split_custom(const std::string & text", "\n}\n")
    regexes: set[str] = set()
    for at in [i + 1 for i, token in enumerate(tokens) if token == "if"]:
        regexes.update(_disjunction(tokens[at + 1 : _closing(tokens, at)], "regex_expr"))
    return regexes


def collapsed_categories(unicode_cpp: str) -> set[str]:
    """The \\p{...} classes unicode_regex_split rewrites into one bracket before std::regex."""
    tokens = _between(unicode_cpp, "k_ucat_enum = {", "};")
    return {_string(token) for token in tokens if token.startswith('"')}


def regexes_by_pre_type(vocab_cpp: str) -> dict[str, list[str]]:
    """llm_tokenizer_bpe's regex_exprs for each pre type, and for "default" those of the rest."""
    tokens = _between(
        vocab_cpp, "switch (vocab.get_pre_type())", "std::vector<std::string> regex_exprs;"
    )
    regexes: dict[str, list[str]] = {}
    cases: list[str] = []  # the case labels of the group being read
    at, end = tokens.index("{") + 1, _closing(tokens, tokens.index("{"))
    while at < end:
        if tokens[at] == "case" and tokens[at + 2] == ":":
            cases.append(tokens[at + 1].removeprefix("LLAMA_VOCAB_PRE_TYPE_"))
            at += 3
        elif tokens[at : at + 2] == ["default", ":"]:
            cases.append("default")
            at += 2
        elif tokens[at : at + 3] == ["regex_exprs", "=", "{"] and cases:
            close = _closing(tokens, at + 2)
            assert tokens[close + 1] == ";", f"{cases}: {REDERIVE}"
            regexes.update(dict.fromkeys(cases, _strings(tokens[at + 3 : close])))
            at = close + 2
        elif tokens[at : at + 2] == ["byte_encode", "="] and tokens[at + 3] == ";":
            at += 4  # how words become bytes, not how text is split
        elif tokens[at : at + 2] == ["break", ";"] and cases and cases[0] in regexes:
            cases, at = [], at + 2
        else:
            raise AssertionError(f"unexpected {tokens[at : at + 4]} in the switch: {REDERIVE}")
    assert not cases, f"{cases} fall out of the switch: {REDERIVE}"
    return regexes


def pre_type_by_name(vocab_cpp: str) -> dict[str, str]:
    """The pre type llama_vocab::load gives each tokenizer.ggml.pre name of a BPE vocabulary
    (the first branch that names it)."""
    tokens = _between(vocab_cpp, "if (type == LLAMA_VOCAB_TYPE_BPE) {", "unknown pre-tokenizer")
    types: dict[str, str] = {}
    for at in [i + 1 for i, token in enumerate(tokens) if token == "if"][1:]:
        close = _closing(tokens, at)
        body = tokens[close + 1 : _closing(tokens, close + 1)]
        assigned = [
            body[i + 2] for i in range(len(body) - 2) if body[i : i + 2] == ["pre_type", "="]
        ]
        assert len(assigned) == 1, f"a branch sets pre_type {len(assigned)} times: {REDERIVE}"
        condition = tokens[at + 1 : close]
        names = [""] if condition == ["tokenizer_pre", ".", "empty", "(", ")"] else (
            _disjunction(condition, "tokenizer_pre")
        )  # fmt: skip
        for name in names:
            types.setdefault(name, assigned[0].removeprefix("LLAMA_VOCAB_PRE_TYPE_"))
    return types


def forced_names(vocab_cpp: str) -> list[str]:
    """Names load() puts in place of the file's (a tokenizer.ggml.model that implies one)."""
    assigned = re.findall(r"\btokenizer_pre\s*=(?!=)\s*([^;]*);", vocab_cpp)
    return [_string(value) for value in assigned]


def one_character(categories: set[str]) -> re.Pattern[str]:
    """Regexes whose every match is one character: a single class, escape or literal, or an
    alternation of them, with no quantifier or group. libstdc++'s std::regex matches one with
    a constant recursion depth, however long the run of characters around it."""
    atom = "|".join(
        [*map(re.escape, sorted(categories)), r"\\[dDsSwW]", r"\[\^?(?:\\.|[^\\\]])+\]",
         r"\\[^\w\s]", r"\.", r"[^\\^$.|?*+()\[\]{}]"]
    )  # fmt: skip
    return re.compile(rf"(?:{atom})(?:\|(?:{atom}))*")


def shallow_names() -> set[str]:
    """The tokenizer.ggml.pre names whose every regex is split by hand or one character at a
    time, from the source the build compiles."""
    vocab_cpp, unicode_cpp = _source()
    by_hand = hand_split_regexes(unicode_cpp)
    single = one_character(collapsed_categories(unicode_cpp))
    by_type = regexes_by_pre_type(vocab_cpp)

    def shallow(pre_type: str) -> bool:
        regexes = by_type.get(pre_type, by_type["default"])
        return all(expr in by_hand or single.fullmatch(expr) for expr in regexes)

    return {name for name, pre_type in pre_type_by_name(vocab_cpp).items() if shallow(pre_type)}


def test_the_derivation_reads_the_pinned_source_as_expected() -> None:
    vocab_cpp, unicode_cpp = _source()
    by_type = regexes_by_pre_type(vocab_cpp)
    assert by_type["STARCODER"] == by_type["COMMAND_R"] == by_type["MELLUM2"]
    assert by_type["STARCODER"][0] == "\\p{N}"
    assert by_type["DEEPSEEK_LLM"][0] == "[\r\n]"  # a C++ escape, not a regex one
    assert len(by_type["default"]) == 4
    gpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
    assert gpt2 in hand_split_regexes(unicode_cpp)
    assert "\\p{N}+" not in hand_split_regexes(unicode_cpp)
    names = pre_type_by_name(vocab_cpp)
    assert names["minicpm5"] == "MINICPM5"  # the first of two branches naming it
    assert names[""] == names["default"] == "DEFAULT"
    single = one_character(collapsed_categories(unicode_cpp))
    for expr in ["\\p{N}", "[\r\n]", "\\d", "[\\p{P}!-/]", "a|\\p{L}"]:
        assert single.fullmatch(expr), expr
    for expr in ["\\p{N}+", "\\p{N}{1,3}", "[0-9][0-9]", "(a)", "\\p{Han}", "\\s?a", "\\b"]:
        assert not single.fullmatch(expr), expr


def test_the_table_is_what_the_source_says() -> None:
    derived = shallow_names()
    wrong = []
    if unsafe := sorted(SHALLOW_SPLIT_PRE - derived):
        wrong.append(
            f"remove {unsafe}: gone, or now reaching a std::regex that recurses per character"
        )
    if shallow := sorted(derived - SHALLOW_SPLIT_PRE):
        wrong.append(f"add {shallow}: new, or no longer reaching one")
    assert not wrong, (
        "SHALLOW_SPLIT_PRE in llamacrab/src/llamacrab/_native/pretokenizer.py disagrees with "
        "the pinned llama.cpp: " + "; ".join(wrong)
    )


def test_no_file_is_made_to_use_a_deeper_pre_tokenizer_than_its_name() -> None:
    # The table reads the file's tokenizer.ggml.pre; a name load() puts in its place (for a
    # tokenizer.ggml.model that implies one: gemma4) must be as shallow.
    forced = forced_names(_source()[0])
    assert set(forced) <= shallow_names(), (
        f"load() sets tokenizer_pre to {forced} for some tokenizer.ggml.model whatever the "
        "file's tokenizer.ggml.pre says: guard those models by their tokenizer.ggml.model too"
    )
