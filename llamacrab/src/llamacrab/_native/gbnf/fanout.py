"""Grammars that would hold the engine inside llama.cpp's grammar sampler, refused first.

llama.cpp keeps one parse stack per way the text so far can continue, and checks each
candidate token character by character against every stack, following every way a character
can continue before it rejects a token. Where a sequence holds optional items in a row (``x?``,
``x*``, an item with an empty alternative, a repetition of such an item), every one of them may
be skipped: a position opens a stack for each item it reaches, and where those items accept the
same characters, a token of L such characters is split among them in every possible way. Both
counts are bounded here, from the grammar's structure (``structure``):

- fan-out: the stacks one position opens (the reliability suite's ``root ::= (r0){1000}`` with
  an ``r0`` that may match nothing: 5000; minutes a token on a 4k vocabulary);
- splits: the ways a string of LONGEST_TOKEN characters, all accepted by every item that
  shares a first character, divides among the optional items of a run.

Measured on Gemma 3's 262k vocabulary, two tokens (0.2-0.3 s without a grammar):
``([a-z]?){16}`` 0.8 s (12,870 splits of 10 characters), ``{24}`` 22 s (1,961,256);
``[a-z]*`` written 8 times 0.9 s (19,448), 12 times 8.5 s (352,716), 24 times over 100 s.
The count assumes every character matches, so it can refuse a grammar whose real tokens never
split that way (``("ab"?){24}``); the JSON Schemas we generate stay far below both bounds.

The start rule's own entry is no item of a sequence: its ways to begin are bounded apart, by
the stacks llamacrab-sys lets a token leave (MAX_START_STACKS), which llama.cpp would only
apply after comparing every stack with every other (``root ::= "w0" | … | "w19999"``).

Left recursion is refused too: a rule that can come back to itself before matching a character.
llama.cpp refuses it only where the way back is a rule with an empty alternative of its own;
through a rule that matches nothing by referring to such a rule (``r0 ::= ("" | "")``) it goes
unnoticed, and a grammar with no other way on starts, or goes on, with no parse stack at all:
``GGML_ASSERT(!stacks.empty())`` aborts the process at the next token (the reliability suite's
inputs section, seed 2031: ``root ::= r0 r1 root ""``).
"""

from __future__ import annotations

import functools

from llamacrab._exceptions import GrammarError
from llamacrab._native.gbnf.structure import (
    Facts,
    Item,
    Parser,
    Unparsed,
    facts,
    item_first,
    item_lengths,
    item_nullable,
)

# Stacks one position may open. Our JSON Schemas open ~11, plus ~2 per optional property (an
# object of 40 optional properties: ~90; llama.cpp's parser refuses 60 of them anyway).
MAX_GRAMMAR_FANOUT = 256
# Stacks the start rule may open (its entry is no item of a sequence, so the bound above misses
# it): llamacrab-sys's bound on the stacks a token leaves (patch llama-grammar-stack-bound),
# which the first token would meet anyway. llama.cpp's start compares each new stack with every
# one before it, and each token's check walks them all: an alternation of 20,000 literals took
# 77 s to be refused by that bound (one of 2,000: 7 s); an enum of 1,000 is a legitimate use.
MAX_START_STACKS = 1024
# Ways a token may split among a run's optional items: ~1 s for two tokens of Gemma 3 at the
# bound (see above). An object's optional properties split a token one way each: ~90 at most.
MAX_GRAMMAR_SPLITS = 50_000
LONGEST_TOKEN = 10  # characters: most tokens of large vocabularies are shorter


def check_grammar_fanout(text: str) -> None:
    """Raise GrammarError if ``text``'s grammar is left-recursive or exceeds
    MAX_GRAMMAR_FANOUT, MAX_START_STACKS or MAX_GRAMMAR_SPLITS; syntax is left to llama.cpp."""
    problem = _problem(text)
    if problem is not None:
        raise GrammarError(problem)


@functools.lru_cache(maxsize=16)  # a server sees the same response_format again and again
def _problem(text: str) -> str | None:
    parser = Parser(text)
    try:
        rules = parser.parse()
    except Unparsed:
        return None
    known = facts(rules)
    reach = _entry_reach(parser, known)
    if isinstance(reach, str):
        return reach
    fanout = splits = 0
    for rule in rules:
        for sequence in rule.alternatives:
            for run in _runs(sequence, known):
                fanout = max(fanout, sum(_item_reach(item, known, reach) for item in run))
                if len(run) > 1 or _copies(run[0], known) > 1:
                    splits = max(splits, _splits(run, known))
    if fanout > MAX_GRAMMAR_FANOUT:
        return (
            f"the grammar can hold {fanout} ways to continue at one position (optional items "
            f"in a row, or a repetition of an optional item); the limit is {MAX_GRAMMAR_FANOUT}"
        )
    if splits > MAX_GRAMMAR_SPLITS:
        return (
            f"the grammar's optional items in a row can split {LONGEST_TOKEN} characters "
            f"{splits} ways, each checked for every token; the limit is {MAX_GRAMMAR_SPLITS} "
            "(bound the repetition of one item instead, e.g. [a-z]{0,24})"
        )
    return _start_problem(parser, reach)


def _start_problem(parser: Parser, reach: list[int]) -> str | None:
    """Whether a rule the grammar may start from opens more than MAX_START_STACKS stacks. The
    caller's ``grammar_root`` picks it ("root" unless told), which this check does not see; a
    rule that another refers to is held to MAX_GRAMMAR_FANOUT already, so every named rule is
    checked: past the bound only where none refers to it."""
    for name, index in parser.names.items():
        if reach[index] > MAX_START_STACKS:
            return (
                f"the grammar's rule {name!r} can begin more than {MAX_START_STACKS} ways (an "
                f"alternation of that many items, say), a parse stack each where the grammar "
                f"starts from it; the limit is {MAX_START_STACKS}, the stacks a token may leave"
            )
    return None


def _runs(sequence: list[Item], known: Facts) -> list[list[Item]]:
    """Each run of skippable items with the first item that is not (where one position's
    stacks stop): the most any position of the sequence reaches is at a run's start."""
    runs: list[list[Item]] = []
    current: list[Item] = []
    for item in sequence:
        current.append(item)
        if not item_nullable(item, known.nullable):
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _copies(item: Item, known: Facts) -> int:
    """Copies of ``item`` one position reaches: every copy of a skippable rule."""
    if item.rule is not None and known.nullable[item.rule]:
        return max(1, item.high if item.high is not None else item.low + 1)
    return 1


def _item_reach(item: Item, known: Facts, reach: list[int]) -> int:
    """Stacks opened by entering ``item``."""
    return (1 if item.rule is None else reach[item.rule]) * _copies(item, known)


def _splits(run: list[Item], known: Facts) -> int:
    """The most ways a string of LONGEST_TOKEN characters or fewer, every character accepted,
    divides in order among the run's items that can start with one same character (each item
    taking nothing or between its shortest and longest match)."""
    items: list[tuple[frozenset[int], int, int]] = []
    for item in run:
        copies = _copies(item, known)
        if copies > 1:  # each copy matches what the rule matches once
            assert item.rule is not None
            lengths = known.shortest[item.rule], known.longest[item.rule]
        else:
            lengths = item_lengths(item, known)
        items += [(item_first(item, known), *lengths)] * copies
    if len(items) < 2:
        return 1
    members: dict[int, list[int]] = {}
    for index, (first, _, _) in enumerate(items):
        for bucket in first:
            members.setdefault(bucket, []).append(index)
    worst = 1
    for group in {tuple(m) for m in members.values() if len(m) > 1}:
        ways = [1] + [0] * LONGEST_TOKEN  # ways[n]: splits of n characters so far
        for index in group:
            _, shortest, longest = items[index]
            longest = min(longest, LONGEST_TOKEN)
            ways = [
                ways[n] + sum(ways[n - k] for k in range(max(shortest, 1), min(longest, n) + 1))
                for n in range(LONGEST_TOKEN + 1)
            ]
        worst = max(worst, max(ways[1:]))
        if worst > MAX_GRAMMAR_SPLITS:
            break
    return worst


def _entry_reach(parser: Parser, known: Facts) -> list[int] | str:
    """Stacks opened by entering each rule, rules reached first computed first (iteratively,
    in an order where a rule comes after those its start reaches); on a cycle, what refuses
    the grammar as left-recursive."""
    rules = parser.rules
    starts: list[set[int]] = []
    for rule in rules:
        reached: set[int] = set()
        for sequence in rule.alternatives:
            for item in sequence:
                if item.rule is not None:
                    reached.add(item.rule)
                if not item_nullable(item, known.nullable):
                    break
        starts.append(reached)
    waiting_on = [len(s) for s in starts]
    users: list[list[int]] = [[] for _ in rules]
    for index, reached in enumerate(starts):
        for other in reached:
            users[other].append(index)
    ready = [i for i, n in enumerate(waiting_on) if n == 0]
    reach = [0] * len(rules)
    while ready:
        index = ready.pop()
        total = 0
        for sequence in rules[index].alternatives:
            for item in sequence:
                total += _item_reach(item, known, reach)
                if not item_nullable(item, known.nullable):
                    break
        # A rule that matches nothing still takes a way per copy: ("" ){0,3000} takes 3000,
        # each explored by llama.cpp (nested twice: all the memory there is).
        total = max(total, 1)
        reach[index] = min(total, MAX_START_STACKS + 1)  # past the limits, the size is moot
        for user in users[index]:
            waiting_on[user] -= 1
            if waiting_on[user] == 0:
                ready.append(user)
    stuck = [i for i, n in enumerate(waiting_on) if n > 0]
    if not stuck:
        return reach
    name = _on_a_cycle(parser, starts, waiting_on, stuck[0])
    return (
        f"the grammar is left-recursive: rule {name!r} can come back to itself before "
        "matching a character (through rules that may match nothing); llama.cpp's parser "
        "cannot run that"
    )


def _on_a_cycle(parser: Parser, starts: list[set[int]], waiting_on: list[int], rule: int) -> str:
    """The name of a rule on the cycle that ``rule`` (one never computed) waits on: only named
    rules can be referred to from elsewhere, so every cycle passes one."""
    seen: dict[int, int] = {}
    while rule not in seen:  # every stuck rule waits on a stuck rule: this walk ends on a cycle
        seen[rule] = len(seen)
        rule = next(r for r in starts[rule] if waiting_on[r] > 0)
    cycle = [r for r, order in seen.items() if order >= seen[rule]]
    names = {index: name for name, index in parser.names.items()}
    return next((names[r] for r in cycle if r in names), "root")
