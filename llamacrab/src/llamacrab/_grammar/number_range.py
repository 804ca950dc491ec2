"""GBNF for integers and numbers between bounds, built digit by digit so that exactly the values
in range match (JSON's form: no leading zeros, at most 16 integer digits, no exponent)."""

from __future__ import annotations

from llamacrab._exceptions import GrammarError
from llamacrab._native.gbnf.repetition import AddRule

MAX_DIGITS = 16
FRACTION = '( "." [0-9]{1,16} )'
ZERO_FRACTION = '( "." "0"{1,16} )'


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


def _magnitude(low: int, high: int | None, fraction: bool) -> str:
    """Non-negative values from ``low`` to ``high``: integers, or numbers with a fraction."""
    if not fraction:
        return natural_range(low, high)
    if high is None:
        return f"( {natural_range(low, None)} ) {FRACTION}?"
    options = [f'"{high}" {ZERO_FRACTION}?']  # the bound itself, with zeros after the point
    if high > low:
        options.insert(0, f"( {natural_range(low, high - 1)} ) {FRACTION}?")
    return " | ".join(options)


def bounded(low: int | None, high: int | None, fraction: bool) -> str:
    """A GBNF alternative for the integers (or, with ``fraction``, the numbers) between two
    integral bounds, either of which may be None."""
    if low is not None and high is not None and low > high:
        raise GrammarError(f"minimum {low} is greater than maximum {high}")
    options = []
    if high is None or high >= 0:
        options.append(_magnitude(max(low or 0, 0), high, fraction))
    if low is None or low < 0:
        # -m is in range when -high <= m <= -low; m = 0 is the non-negative side's.
        smallest = 0 if high is None or high >= 0 else -high
        magnitude = _magnitude(max(smallest, 0 if fraction else 1), None if low is None else -low,
                               fraction)  # fmt: skip
        options.append(f'"-" ( {magnitude} )')
    return " | ".join(f"( {o} )" for o in options)


def integral_bound(value: object, keyword: str, hint: str) -> int:
    """A schema bound as an int; only integral values can become digit rules."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GrammarError(f"{keyword} at {hint} must be a number, not {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise GrammarError(
            f"JSON Schema keyword {keyword!r} at {hint}: only whole-number bounds are supported, "
            f"not {value}"
        )
    if abs(value) >= 10**MAX_DIGITS:
        raise GrammarError(f"{keyword} {value} at {hint} has more than {MAX_DIGITS} digits")
    return int(value)


# multipleOf: a divisibility automaton has a rule per remainder and digit count, so the divisor is
# bounded; a
# bounded range of up to MAX_LISTED multiples is written out instead.
MAX_DIVISOR = 64  # a rule per remainder and digit count: at most 960 rules, ~140 KB
MAX_DIGITS = 16  # digits of an integer, as json-integer bounds them
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
