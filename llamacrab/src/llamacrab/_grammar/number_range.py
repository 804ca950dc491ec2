"""GBNF for integers and numbers between bounds, built digit by digit so that exactly the values
in range match (JSON's form: no leading zeros, at most 16 integer digits, a fraction of at most
16 digits, no exponent), each text by one reading: alternatives differ in the sign, the integer
part or the first digit where they part, never in how a text is split between them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from decimal import Context as DecimalContext

from llamacrab._exceptions import GrammarError
from llamacrab._native.gbnf.repetition import AddRule

MAX_DIGITS = 16  # digits of an integer part, and of a fraction, as json-number bounds them
_STEP = Decimal(1).scaleb(-MAX_DIGITS)  # between two numbers of the grammar, at least
_WIDE = DecimalContext(prec=2 * MAX_DIGITS + 8)  # exact for every number of the grammar
FRACTION = '( "." [0-9]{1,16} )'


@dataclass(frozen=True)
class Bound:
    """One end of a range: its value, whether the value itself is out, and the schema keyword
    that set it (to name it in an error)."""

    value: Decimal
    exclusive: bool = False
    keyword: str = "bound"

    def __str__(self) -> str:
        return f"{self.keyword} {self.value}"


def decimal_bound(value: object, keyword: str, hint: str, whole: bool) -> Bound | None:
    """A schema's minimum/maximum/exclusive* as an exact Bound, or None where every number of
    the grammar (at most 16 digits each side of the point) is within it anyway (an int64
    limit, ``maximum: 1.8e308``). A float is read as the decimal JSON wrote (its shortest repr:
    0.1, not 0.1000000000000000055...). A bound between two numbers of the grammar's 16
    decimals is the nearest one inside it, inclusive (``exclusiveMinimum: 1e-17`` is
    ``minimum: 0.0000000000000001``): the same numbers of the grammar pass."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GrammarError(f"{keyword} at {hint} must be a number, not {value!r}")
    exact = Decimal(repr(value) if isinstance(value, float) else value)
    if exact.is_nan():
        raise GrammarError(f"{keyword} at {hint} must be a number, not {value}")
    lower = keyword.lower().endswith("minimum")
    # Past 16 digits (an infinity too: JSON's 1e999 as Python reads it), the bound is beyond
    # every number of the grammar on one side.
    if exact.is_infinite() or abs(exact) >= 10**MAX_DIGITS:
        if (exact < 0) == lower:  # below every number of the grammar, or above every one
            return None
        raise GrammarError(
            f"{keyword} {value} at {hint} leaves no number of at most {MAX_DIGITS} digits"
        )
    if not whole and exact != exact.quantize(_STEP, context=_WIDE):
        rounding = ROUND_CEILING if lower else ROUND_FLOOR
        return Bound(exact.quantize(_STEP, rounding=rounding, context=_WIDE), keyword=keyword)
    return Bound(exact, exclusive=keyword.startswith("exclusive"), keyword=keyword)


def tighter(old: Bound | None, new: Bound, lower: bool) -> Bound:
    """The stricter of two lower (or upper) bounds; at one value, the exclusive one."""
    if old is None or old.value == new.value:
        return new if old is None or new.exclusive else old
    return new if (new.value > old.value) == lower else old


def whole_range(low: Bound | None, high: Bound | None) -> tuple[int | None, int | None]:
    """The integers between two bounds, as inclusive ends (JSON Schema compares an integer with
    a bound as numbers: ``minimum: 0.5`` lets 1 in, not 0)."""
    _check_order(low, high, "integer")
    first = last = None
    if low is not None:
        first = math.floor(low.value) + 1 if low.exclusive else math.ceil(low.value)
    if high is not None:
        last = math.ceil(high.value) - 1 if high.exclusive else math.floor(high.value)
    if first is not None and last is not None and first > last:
        raise GrammarError(f"{low} and {high} leave no integer between them")
    return first, last


def _check_order(low: Bound | None, high: Bound | None, kind: str) -> None:
    if low is None or high is None:
        return
    if low.value > high.value:
        raise GrammarError(f"{low} is greater than {high}")
    if low.value == high.value and (low.exclusive or high.exclusive):
        raise GrammarError(f"{low} and {high} leave no {kind} between them")


def _same_length(low: str, high: str) -> str:
    """Digit strings of one length from ``low`` to ``high`` (inclusive, low <= high)."""
    if low == high:
        return f'"{low}"'
    i = next(k for k, (a, b) in enumerate(zip(low, high, strict=True)) if a != b)
    prefix = f'"{low[:i]}" ' if i else ""
    rest = len(low) - i - 1
    first, last = int(low[i]), int(high[i])
    tail = f" [0-9]{{{rest}}}" if rest else ""
    if low[i + 1 :] == "0" * rest and high[i + 1 :] == "9" * rest:
        return f"{prefix}[{first}-{last}]{tail}"
    options = [f'"{first}" ( {_same_length(low[i + 1 :], "9" * rest)} )']
    if last - first > 1:
        options.append(f"[{first + 1}-{last - 1}]{tail}")
    options.append(f'"{last}" ( {_same_length("0" * rest, high[i + 1 :])} )')
    return f"{prefix}( {' | '.join(options)} )"


def natural_range(low: int, high: int | None) -> str:
    """The integers from ``low`` (>= 0) to ``high`` (None: up to 16 digits), unsigned."""
    top = len(str(high)) if high is not None else len(str(low))
    options = []
    for length in range(len(str(low)), top + 1):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        end = 10**length - 1 if high is None else min(high, 10**length - 1)
        if start <= end:
            options.append(_same_length(str(start), str(end)))
    if high is None and top < MAX_DIGITS:  # every longer number is larger
        options.append(f"[1-9] [0-9]{{{top},{MAX_DIGITS - 1}}}")
    return " | ".join(f"( {o} )" for o in options)


def bounded(low: Bound | int | None, high: Bound | int | None, fraction: bool) -> str:
    """A GBNF alternative for the integers (or, with ``fraction``, the numbers) between two
    bounds, either of which may be None (an int is an inclusive bound)."""
    lower = Bound(Decimal(low), keyword="minimum") if isinstance(low, int) else low
    upper = Bound(Decimal(high), keyword="maximum") if isinstance(high, int) else high
    if not fraction:
        return _integers(*whole_range(lower, upper))
    _check_order(lower, upper, "number")
    options = []
    if upper is None or upper.value > 0 or (upper.value == 0 and not upper.exclusive):
        start = (Decimal(0), False) if lower is None or lower.value < 0 else _end(lower)
        options.append(_unsigned(start, None if upper is None else _end(upper)))
    if lower is None or lower.value < 0:
        # -m is in range when -high <(=) m <(=) -low; m = 0 is the unsigned side's, "-0" no one's
        start = (Decimal(0), True)
        if upper is not None and upper.value < 0:
            start = (-upper.value, upper.exclusive)
        magnitude = _unsigned(start, None if lower is None else (-lower.value, lower.exclusive))
        options.append(None if magnitude is None else f'"-" ( {magnitude} )')
    kept = [o for o in options if o is not None]
    if not kept:
        raise GrammarError(
            f"{lower} and {upper} leave no number of at most {MAX_DIGITS} digits between them"
        )
    return " | ".join(f"( {o} )" for o in kept)


def _integers(low: int | None, high: int | None) -> str:
    """The integers from ``low`` to ``high`` (inclusive; None: unbounded), of at most 16 digits."""
    most = 10**MAX_DIGITS - 1
    if (low is not None and low > most) or (high is not None and high < -most):
        raise GrammarError(f"no integer of at most {MAX_DIGITS} digits from {low} to {high}")
    options = []
    if high is None or high >= 0:
        options.append(natural_range(max(low or 0, 0), high))
    if low is None or low < 0:
        smallest = 1 if high is None or high >= 0 else -high  # -0 is no one's
        options.append(f'"-" ( {natural_range(smallest, None if low is None else -low)} )')
    return " | ".join(f"( {o} )" for o in options)


End = tuple[Decimal, bool]  # a value >= 0 and whether it is excluded
_Rest = tuple[str, bool, str | None, bool]  # _fraction's low, above, high, below after a digit


def _end(bound: Bound) -> End:
    return bound.value, bound.exclusive


def _digits(value: Decimal) -> tuple[int, str]:
    """The integer part of ``value`` (>= 0) and its fraction's digits, trailing zeros dropped
    (0.50 compares with a value's fraction as 0.5 does)."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _unsigned(start: End, end: End | None) -> str | None:
    """Unsigned numbers from ``start`` to ``end`` (None: any up to 16 digits), by integer part:
    start's own (its fraction bounded below), the ones between (any fraction), end's own (its
    fraction bounded above). None if none is in range."""
    first, low = _digits(start[0])
    last, high = _digits(end[0]) if end is not None else (None, None)
    below = end is not None and end[1]
    if first == last:
        return _then(f'"{first}"', _fraction(low, high, MAX_DIGITS, start[1], below))
    options = []
    if low or start[1]:  # start's integer part takes only some fractions
        options.append(_then(f'"{first}"', _fraction(low, None, MAX_DIGITS, start[1], False)))
        first += 1
    top = None if last is None else last - 1
    if first < 10**MAX_DIGITS and (top is None or first <= top):
        options.append(f"( {natural_range(first, top)} ) {FRACTION}?")
    if last is not None:
        options.append(_then(f'"{last}"', _fraction("", high, MAX_DIGITS, False, below)))
    kept = [o for o in options if o is not None]
    return " | ".join(f"( {o} )" for o in kept) if kept else None


def _then(head: str, tail: tuple[bool, str | None]) -> str | None:
    """``head`` (an integer part) followed by the fractions of ``tail`` (see _fraction)."""
    empty, digits = tail
    if digits is None:
        return head if empty else None
    return f'{head} ( "." ( {digits} ) )?' if empty else f'{head} "." ( {digits} )'


def _fraction(
    low: str, high: str | None, left: int, above: bool, below: bool
) -> tuple[bool, str | None]:
    """Digit strings S of at most ``left`` digits with 0.S >= 0.low (> if ``above``) and
    0.S <= 0.high (< if ``below``; high None: no upper end): whether S may be empty, and an
    alternative for the others (None: there are none). ``low`` and ``high`` have no trailing
    zeros, so a digit string that stops short of ``low`` is below it."""
    if high is None and not low and not above:  # any fraction
        return True, (f"[0-9]{{1,{left}}}" if left else None)
    if high == "":  # 0.S <= 0: zeros only, when 0 itself is in
        fits = not low and not above and not below
        return fits, (f'"0"{{1,{left}}}' if fits and left else None)
    empty = not low and not above
    if left == 0:
        return empty, None
    first, last = int(low[0]) if low else 0, 9 if high is None else int(high[0])
    runs: list[tuple[int, int, _Rest]] = []  # neighbour digits that leave the same rest: one class
    for digit in range(first, last + 1):
        rest: _Rest = (
            low[1:] if digit == first else "",
            above and digit == first,
            high[1:] if high is not None and digit == last else None,
            below and high is not None and digit == last,
        )
        if runs and runs[-1][2] == rest:
            runs[-1] = (runs[-1][0], digit, rest)
        else:
            runs.append((digit, digit, rest))
    options = []
    for a, b, rest in runs:
        chars = f'"{a}"' if a == b else f"[{a}-{b}]"
        if rest == ("", False, None, False):  # any digits may follow
            options.append(f"{chars} [0-9]{{0,{left - 1}}}" if left > 1 else chars)
            continue
        more, after = _fraction(rest[0], rest[2], left - 1, rest[1], rest[3])
        if after is not None:
            options.append(f"{chars} ( {after} )?" if more else f"{chars} ( {after} )")
        elif more:
            options.append(chars)
    return empty, " | ".join(options) or None


# multipleOf: a divisibility automaton has a rule per remainder and digit count, so the divisor is
# bounded; a bounded range of up to MAX_LISTED multiples is written out instead.
MAX_DIVISOR = 64  # a rule per remainder and digit count: at most 960 rules, ~140 KB
MAX_LISTED = 256


def multiples(step: int, low: int | None, high: int | None, add: AddRule, hint: str) -> str:
    """A GBNF alternative for the integers divisible by ``step`` (> 0) between two bounds,
    either of which may be None. Bounds that cut into the multiples of one sign without
    listing them are refused: that needs the range and the automaton combined."""
    if low is not None and high is not None:
        values = range(-(-low // step) * step, high + 1, step)
        if not values:
            raise GrammarError(f"{hint}: no multiple of {step} from {low} to {high}")
        if len(values) <= MAX_LISTED:
            return " | ".join(f'"{v}"' for v in values)
    positives_all = high is None and (low is None or low <= step)
    negatives_all = low is None and (high is None or high >= -step)
    if not (positives_all or (high is not None and high < step)) or not (
        negatives_all or (low is not None and low > -step)
    ):
        raise GrammarError(
            f"{hint}: multipleOf {step} with bounds between which lie more than {MAX_LISTED} "
            "multiples is not supported (bound it closer, or at 0)"
        )
    if step > MAX_DIVISOR:
        raise GrammarError(f"{hint}: multipleOf above {MAX_DIVISOR} is not supported")
    positive = _divisible(step, add)
    options = [positive] if positives_all else []
    if negatives_all:
        options.append(f'"-" {positive}')
    if (low is None or low <= 0) and (high is None or high >= 0):
        options.append('"0"')
    return " | ".join(options)


def _divisible(step: int, add: AddRule) -> str:
    """The positive multiples of ``step`` in decimal, of at most MAX_DIGITS digits (as any
    integer of the grammar: a number with no end would let a model write digits until its
    budget ran out): a rule per remainder of the digits read so far and per count of digits
    that may still follow, each digit leading to the next; the number may end at remainder 0.
    Only moves from which the number can still end are written."""
    # can_end[left][r]: whether a number at remainder r may end within ``left`` more digits
    can_end = [[r == 0 for r in range(step)]]
    for _ in range(1, MAX_DIGITS):
        below = can_end[-1]
        can_end.append([r == 0 or any(below[(r * 10 + d) % step] for d in range(10))
                        for r in range(step)])  # fmt: skip

    def moves(remainder: int, left: int, digits: range) -> str:
        """Alternatives after ``remainder`` with ``left`` digits allowed (one is read here)."""
        targets: dict[int, str] = {}
        for digit in digits:
            target = (remainder * 10 + digit) % step
            if can_end[left - 1][target]:
                targets[target] = targets.get(target, "") + str(digit)
        return " | ".join(
            f"[{chars}]" if left == 1 else f"[{chars}] {state(target, left - 1)}"
            for target, chars in targets.items()
        )

    names: dict[tuple[int, int], str] = {}  # each state's rule, made once

    def state(remainder: int, left: int) -> str:
        if (remainder, left) not in names:
            body = moves(remainder, left, range(10))
            rule = f"( {body} )?" if remainder == 0 else body
            names[remainder, left] = add(f"mod-{step}-{remainder}-{left}", rule)
        return names[remainder, left]

    return f"( {moves(0, MAX_DIGITS, range(1, 10))} )"
