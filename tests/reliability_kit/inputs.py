"""Grammar, JSON Schema and chat template fuzzing through the public API.

Cases are drawn with hypothesis in the parent: GBNF grammars (generated rule trees, then some
with a character deleted, doubled or swapped, and families nested or repeated past the
limits), JSON Schemas (generated, with malformed values among them, deep nesting, huge bounds,
regular-expression patterns) and Jinja chat templates (snippets of what real templates do, and
what hostile ones try: unbounded output, recursion, deep nesting, sandbox escapes) with
messages that carry NULs, special tokens, huge or non-text content. In the child each goes
through ``create_completion(grammar=...)``, ``create_chat_completion(response_format=...)`` or
``create_chat_completion(chat_format=<template>)`` (and a template embedded in a GGUF file), on
the tiny model. A LlamaError is a refusal; anything else escaping is unclean; the time limit
(per case) and the address-space limit (per child) bound time and memory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from reliability_kit.repo import script

NESTING = (10, 64, 65, 127, 128, 129, 500, 5000)


# -- generation (parent) -----------------------------------------------------------------------


def _gbnf_strategy() -> Any:
    from hypothesis import strategies as st

    chars = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
    literal = chars.map(lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"')
    klass = st.tuples(st.booleans(), st.lists(st.sampled_from(
        ["a-z", "0-9", "z-a", "\\x41", "\\u00e9", "\\U0001F600", "\\n", "^", "\\]", "-", "",
         "\\uD800", "\\x", "\\"]), max_size=4)).map(
        lambda t: "[" + ("^" if t[0] else "") + "".join(t[1]) + "]")  # fmt: skip
    ref = st.sampled_from(["r0", "r1", "r2", "undefined-rule", "root"])
    leaf = st.one_of(literal, klass, ref, st.just("."))

    def extend(inner: Any) -> Any:
        repeat = st.sampled_from(["*", "+", "?", "{3}", "{2,}", "{0,5}", "{1000}", "{0,100000}",
                                  "{5,2}", "{", "{-1}"])  # fmt: skip
        return st.one_of(
            st.lists(inner, min_size=1, max_size=4).map(" ".join),
            st.lists(inner, min_size=2, max_size=4).map(lambda xs: "(" + " | ".join(xs) + ")"),
            st.tuples(inner, repeat).map(lambda t: f"({t[0]}){t[1]}"),
        )

    expr = st.recursive(leaf, extend, max_leaves=12)
    rules = st.lists(expr, min_size=1, max_size=4).map(
        lambda xs: "root ::= " + xs[0] + "".join(f"\nr{i} ::= {x}" for i, x in enumerate(xs[1:]))
    )
    edit = st.tuples(st.sampled_from(["none", "none", "delete", "double", "swap", "cut"]),
                     st.integers(0, 10_000))  # fmt: skip
    return st.tuples(rules, edit).map(lambda t: _edit(*t))


# Terminals of the grammars that run, listed so that references (up to 4 names) are under a
# third of the leaves: more reference the rule they are in, and more are left-recursive.
_TERMINALS = ['""', '""', '"a"', '"b"', '"ab"', '" "', '"\\n"', '"é"', "[a-z]", "[^a]", "."]


def _runnable_gbnf_strategy() -> Any:
    """Grammars that parse and mostly run: every reference names a defined rule. The strategy
    above mostly draws grammars that llama.cpp or our checks refuse before they run; a search
    shaped like this one found the ambiguous grammar of ambiguous.gbnf."""
    from hypothesis import strategies as st

    def extend(inner: Any) -> Any:
        repeat = st.sampled_from(["*", "+", "?", "{0,1}", "{2,3}", "{3}", "{0,}"])
        return st.one_of(
            st.lists(inner, min_size=1, max_size=3).map(" ".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " | ".join(xs) + ")"),
            st.tuples(inner, repeat).map(lambda t: f"({t[0]}){t[1]}"),
        )

    @st.composite
    def grammar(draw: Any) -> str:
        names = ["root", "r0", "r1", "r2"][: draw(st.integers(1, 4))]
        expr = st.recursive(st.sampled_from(_TERMINALS + names), extend, max_leaves=8)
        alternatives = st.lists(expr, min_size=1, max_size=3).map(" | ".join)
        return "\n".join(f"{name} ::= {draw(alternatives)}" for name in names)

    return grammar()


def _edit(text: str, edit: tuple[str, int]) -> str:
    kind, at = edit
    if not text or kind == "none":
        return text
    at %= len(text)
    if kind == "delete":
        return text[:at] + text[at + 1 :]
    if kind == "double":
        return text[:at] + text[at] + text[at:]
    if kind == "swap":
        return text[:at] + text[at + 1 : at + 2] + text[at : at + 1] + text[at + 2 :]
    return text[:at]


def _gbnf_families() -> list[str]:
    out = []
    for depth in NESTING:
        out.append("root ::= " + "(" * depth + '"a"' + ")" * depth)
        out.append("root ::= " + '("a" ' * depth + ")" * depth)
        out.append("root ::= " + "(" * depth + '"a"')  # unclosed
        out.append("root ::= " + "[a-z]*" + "(" * depth + '"a"*' + ")*" * depth)
    for n in (100, 8000, 8193, 20_000):
        out.append("".join(f"r{i} ::= r{i + 1} | \"x\"\n" for i in range(n)) + f'r{n} ::= "a"\n'
                   + "root ::= r0")  # fmt: skip
    out += [
        'root ::= root "a"',  # left recursion
        'root ::= r0 r1 root ""\nr0 ::= ("" | "")\nr1 ::= ""',  # through a group: seed 2031
        # Ambiguous: r2 starts root over after any character; sampled, its stacks multiply
        # with each token (tests/test_crash_proof.py: the bound stops it).
        Path(__file__).with_name("ambiguous.gbnf").read_text(encoding="utf-8"),
        'root ::= a\na ::= b "x"\nb ::= a "y"',
        'root ::= "a"{0,100000}',
        'root ::= ("a"{0,1000}){0,1000}',
        'root ::= "a"{4294967295}',
        "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000)),
        'root ::= "' + "x" * 200_000 + '"',
        "root ::= [" + "a-b" * 50_000 + "]",
        'root ::= "\\',
        "root ::= [\\",
        "root ::= \x00",
        "root ::= [^]*",
        'root ::= "\\U0011FFFF"',
        "root ::= {",
        "",
        "::=",
        'root ::= "a" # comment without newline',
    ]
    return out


def _schema_strategy() -> Any:
    from hypothesis import strategies as st

    pattern = st.sampled_from(["^[a-z]+$", "a{2,5}", "(ab|cd)*", "[", "(", "a{100000}", "\\d+",
                               "^(a|b|(c|(d|e)))$", "[^\\x00-\\x1f]{1,3}", "(?=a)", "a**",
                               "((((((((((a))))))))))", "[z-a]", "\\", "é🙂+"])  # fmt: skip
    number = st.sampled_from([0, 1, -1, 2**31, 10**12, -(10**308), 1.5, float("inf"), None, "x"])
    leaf = st.one_of(
        st.fixed_dictionaries({"type": st.just("string")}, optional={
            "minLength": number, "maxLength": number, "pattern": pattern,
            "format": st.sampled_from(["date", "date-time", "uuid", "email", "bogus"])}),
        st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
            "minimum": number, "maximum": number, "exclusiveMinimum": number,
            "multipleOf": number}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.just({}),
        st.lists(st.one_of(st.text(max_size=5), st.integers(), st.none()), max_size=4).map(
            lambda xs: {"enum": xs}),
        st.text(max_size=8).map(lambda x: {"const": x}),
        st.sampled_from([{"$ref": "#/$defs/a"}, {"$ref": "#/nope"}, {"$ref": 5},
                         {"$ref": "http://example.com/x"}, {"$ref": "#"}]),
        st.sampled_from([{"type": 5}, {"type": ["string", "null"]}, {"type": "bogus"},
                         {"enum": 5}, {"properties": []}, {"items": "x"}, {"required": "a"},
                         {"minLength": "x"}, {"anyOf": 5}, {"allOf": []}, [], "x", 5, None,
                         True, False]),
    )  # fmt: skip

    def extend(inner: Any) -> Any:
        names = st.text(min_size=0, max_size=6)
        return st.one_of(
            st.fixed_dictionaries(
                {"type": st.just("object"),
                 "properties": st.dictionaries(names, inner, max_size=4)},
                optional={"required": st.lists(names, max_size=3),
                          "additionalProperties": st.one_of(st.booleans(), inner),
                          "minProperties": number, "maxProperties": number}),
            st.fixed_dictionaries(
                {"type": st.just("array"), "items": inner},
                optional={"minItems": number, "maxItems": number,
                          "prefixItems": st.lists(inner, max_size=3)}),
            st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
            st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"oneOf": xs}),
            st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"allOf": xs}),
            st.tuples(inner, inner).map(lambda t: {**(t[0] if isinstance(t[0], dict) else {}),
                                                   "$defs": {"a": t[1]}}),
        )  # fmt: skip

    return st.recursive(leaf, extend, max_leaves=10)


def _schema_families() -> list[dict[str, Any]]:
    """Deep or huge schemas, as specs the child builds (JSON cannot carry 5,000 levels)."""
    out: list[dict[str, Any]] = []
    for depth in NESTING:
        for family in ("arrays", "objects", "pattern", "anyof"):
            out.append({"family": family, "depth": depth})
    for i in range(10):
        out.append({"family": "fixed", "index": i})
    return out


def build_schema(spec: dict[str, Any]) -> Any:
    depth = spec.get("depth", 0)
    schema: Any
    if spec["family"] == "arrays":
        schema = {"type": "string"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
    elif spec["family"] == "objects":
        schema = {"type": "integer"}
        for i in range(depth):
            schema = {"type": "object", "properties": {f"p{i}": schema}, "required": [f"p{i}"]}
    elif spec["family"] == "pattern":
        schema = {"type": "string", "pattern": "(" * depth + "a" + ")" * depth}
    elif spec["family"] == "anyof":
        schema = {"type": "null"}
        for _ in range(depth):
            schema = {"anyOf": [schema, {"type": "boolean"}]}
    else:
        schema = [
            {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},  # a reference loop
            {"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
             "$ref": "#/$defs/a"},
            {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(5000)}},
            {"enum": list(range(20_000))},
            {"type": "string", "minLength": 10**9},
            {"type": "array", "items": {"type": "integer"}, "minItems": 10**6},
            {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2},
            {"type": "integer", "minimum": 10**30, "maximum": -(10**30)},
            {"type": "string", "pattern": "a{0,100000}"},
            {"type": "string", "pattern": "[" + "a-z" * 20_000 + "]"},
        ][spec["index"]]  # fmt: skip
    return schema


SNIPPETS = (
    "{{ m.content }}",
    "{{ m.role | upper }}: {{ m.content | trim }}\n",
    "{% if m.role == 'user' %}<u>{{ m.content }}</u>{% elif m.role == 'system' %}{{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}",
    "{{ raise_exception('refused') }}",
    "{{ m.content * 1000 }}",
    "{{ messages | tojson }}",
    "{% set ns = namespace(x='') %}{% for i in range(3000) %}{% set ns.x = ns.x ~ ns.x ~ 'ab' %}"
    "{% endfor %}{{ ns.x | length }}",
    "{{ 'a' * 10**7 }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ m.content[::-1] }}",
    "{{ undefined.x.y }}{{ nothing | default('d') }}",
    "{{ m.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ m.content.format(x=1) }}",
    "{{ '%99999999s' % 'a' }}",
    "{{ '{:>99999999}'.format('a') }}",
    "{{ range(10**9) | list | length }}",
    "{{ 2 ** 100000 }}",
    "{{ 10 ** 10 ** 10 }}",
    "{{ tools | tojson }}",
    "{{ strftime_now('%Y') }}",
    "{% generation %}{{ m.content }}{% endgeneration %}",
    "{% for x in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{% if %}",
    "{{",
    "{% for %}",
    "{% endfor %}",
    "{{ messages[0].content | from_json }}",
    "{{ m.content | center(10**8) }}",
    "{{ [m] * 10**6 | length }}",
    "{% set xs = [] %}{% for i in range(100000) %}{% set _ = xs.append(xs) %}{% endfor %}",
    "{{ m.tool_calls | tojson }}",
    "{% while true %}{% endwhile %}",
    "{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}",
)


def _template_strategy() -> Any:
    from hypothesis import strategies as st

    body = st.lists(st.sampled_from(SNIPPETS), min_size=1, max_size=4).map("".join)
    wrap = st.sampled_from(["loop", "plain", "nested-if", "nested-for", "parens", "filters"])
    depth = st.sampled_from(NESTING)
    return st.tuples(body, wrap, depth).map(lambda t: _wrap(*t))


def _wrap(body: str, how: str, depth: int) -> str:
    if how == "loop":
        return "{% for m in messages %}" + body + "{% endfor %}{% if add_generation_prompt %}>"
    if how == "nested-if":
        return "{% if true %}" * depth + body + "{% endif %}" * depth
    if how == "nested-for":
        return "{% for m in messages %}" * min(depth, 40) + body + "{% endfor %}" * min(depth, 40)
    if how == "parens":
        return "{{ " + "(" * depth + "1" + ")" * depth + " }}" + body
    if how == "filters":
        return "{{ 'x'" + " | upper" * depth + " }}" + body
    return body


def _messages_strategy() -> Any:
    from hypothesis import strategies as st

    content = st.one_of(
        st.text(max_size=40),
        st.sampled_from(["a\0b", "<s></s><|im_start|>", "é🙂" * 100, "x" * 200_000, "",
                         "{{ 7 * 7 }}", "{% raw %}"]),
        st.sampled_from([None, 5, [{"type": "text", "text": "hi"}], [{"type": "image"}],
                         {"a": 1}, ["x"]]),
    )  # fmt: skip
    role = st.sampled_from(["user", "user", "system", "assistant", "tool", "developer", "bogus"])
    message = st.fixed_dictionaries({"role": role, "content": content})
    return st.lists(message, min_size=0, max_size=4)


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` input cases (about a third each of grammars, schemas and templates), the
    nesting families first, drawn with hypothesis from ``seed``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    cases: list[dict[str, Any]] = []
    cases += [{"kind": "gbnf", "text": g} for g in _gbnf_families()]
    cases += [{"kind": "schema", "family": s} for s in _schema_families()]
    formats = ["chatml", "llama3", "gemma", "mistral-instruct", "alpaca", "plain", "bogus"]
    drawn: list[dict[str, Any]] = []
    strategy = st.one_of(
        st.tuples(st.just("gbnf"), st.one_of(_gbnf_strategy(), _runnable_gbnf_strategy())),
        st.tuples(st.just("schema"), _schema_strategy()),
        st.tuples(st.just("template"), _template_strategy(), _messages_strategy(),
                  st.booleans()),
        st.tuples(st.just("builtin"), st.sampled_from(formats), _messages_strategy()),
    )  # fmt: skip
    wanted = max(0, count - len(cases))

    @hypothesis_seed(seed)
    @settings(max_examples=max(wanted, 1), database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def collect(drawn_case: tuple[Any, ...]) -> None:
        kind = drawn_case[0]
        if kind == "gbnf":
            drawn.append({"kind": "gbnf", "text": drawn_case[1]})
        elif kind == "schema":
            drawn.append({"kind": "schema", "schema": drawn_case[1]})
        elif kind == "template":
            drawn.append({"kind": "template", "template": drawn_case[1],
                          "messages": drawn_case[2], "in_gguf": drawn_case[3]})  # fmt: skip
        else:
            drawn.append({"kind": "builtin", "format": drawn_case[1], "messages": drawn_case[2]})

    if wanted:
        collect()
    rng = random.Random(seed)
    while drawn and len(drawn) < wanted:
        drawn.append(drawn[rng.randrange(len(drawn))])
    cases += drawn[:wanted]
    out = []
    for i, case in enumerate(cases):
        try:
            json.dumps(case, allow_nan=True)
        except (TypeError, ValueError):
            continue
        out.append({"id": f"inputs-{seed}-{i}", **case})
    return out


# -- execution (child) -------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    from llamacrab import Llama

    llm = Llama(config["model"], n_ctx=512, n_batch=512, n_threads=1, seed=0)
    directory = Path(config["workdir"])
    directory.mkdir(parents=True, exist_ok=True)
    return {"llm": llm, "dir": directory, "slot": slot}


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    llm = state["llm"]
    kind = case["kind"]
    if kind == "gbnf":
        result = llm.create_completion("the cat", max_tokens=8, grammar=case["text"],
                                       temperature=0.8, seed=1)  # fmt: skip
        return "ok", f"{result.usage.completion_tokens} tokens"
    if kind == "schema":
        schema = build_schema(case["family"]) if "family" in case else case["schema"]
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
        chat = llm.create_chat_completion([{"role": "user", "content": "give JSON"}],
                                          chat_format="chatml", max_tokens=8,
                                          response_format=response_format)  # fmt: skip
        return "ok", f"{chat.usage.completion_tokens} tokens"
    messages = case["messages"]
    if kind == "builtin":
        chat = llm.create_chat_completion(messages, chat_format=case["format"], max_tokens=2)
        return "ok", f"{chat.usage.prompt_tokens} prompt tokens"
    if case.get("in_gguf"):
        return _template_in_gguf(case, state)
    chat = llm.create_chat_completion(messages, chat_format=case["template"], max_tokens=2)
    return "ok", f"{chat.usage.prompt_tokens} prompt tokens"


def _template_in_gguf(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    """The template as the model's own: written into a tiny GGUF (tokenizer.chat_template)."""
    from llamacrab import Llama

    write_tiny_llama = script("make_tiny_gguf").write_tiny_llama

    path = state["dir"] / f"template-{state['slot']}.gguf"
    write_tiny_llama(path, chat_templates={"": case["template"]})
    with Llama(path, n_ctx=512, n_threads=1) as llm:
        chat = llm.create_chat_completion(case["messages"], max_tokens=2)
    return "ok", f"{chat.usage.prompt_tokens} prompt tokens"
