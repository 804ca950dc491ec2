"""Chat templates rendered with Jinja2 in a sandbox: templates from model files are untrusted.

The sandbox refuses attribute escapes (``__class__``, ``mro`` and the like) and mutation of
the values passed in; lists and dicts a template builds itself it may change (``append``,
``pop``, ``update``: real templates keep queues that way). Rendering is bounded in output size
and time, so a template that loops forever or grows without end raises TemplateError instead of
hanging the process.

What templates written for Hugging Face transformers and llama.cpp expect is provided:
``tojson`` (of generators too: ``tools|map(attribute='function')|tojson``), ``from_json``, the
``{% generation %}`` block, ``raise_exception`` and ``strftime_now``; as llama.cpp's engine
does, an undefined attribute of an undefined value is undefined, and ``+`` of a string with
none or an undefined value treats the missing side as empty.

The time limit cannot stop one C-level operation, so the operations that build a value in one
step are bounded before they run: string and list repetition and concatenation (``*``, ``+``),
``%`` and ``str.format`` widths and fields, integer ``**`` and ``*``, the ``join``,
``replace``, ``center``, ``indent``, ``format``, ``sum`` and ``tojson`` filters, the string (and
bytes) methods that pad, join, translate or replace, and the list and dict methods that grow a
value (``append``, ``extend``, ``update`` ...).
``range`` is bounded by Jinja's sandbox (``jinja2.sandbox.MAX_RANGE``).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import re
import string
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import BuiltinFunctionType, FrameType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.filters import FILTERS
from jinja2.parser import Parser
from jinja2.runtime import ChainableUndefined, Context, Undefined
from jinja2.sandbox import SandboxedEnvironment, modifies_known_mutable

from llamacrab._exceptions import TemplateError
from llamacrab._field_types import decimal

MAX_OUTPUT_CHARS = 1_000_000
MAX_SECONDS = 2.0
# The largest string (characters) or list (items, counting the characters of the strings in
# it) one template operation may build, and the largest integer (bits) ``*`` or ``**`` may.
MAX_VALUE_SIZE = 1_000_000
MAX_INT_BITS = 10_000
MAX_JSON_SPACING = 64  # tojson's indent and separators (real templates use 1 to 4)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the messages: {message}")


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _json_default(value: Any) -> Any:
    """What ``json.dumps`` cannot write itself: a generator or other iterable (``map``,
    ``select`` and friends return them) becomes a list, a mapping a dict, undefined null."""
    if isinstance(value, Undefined):
        return None
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (Iterator, Iterable)) and not isinstance(value, (str, bytes)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
    **_: Any,
) -> str:
    """Hugging Face's ``tojson``: non-ASCII kept, key order kept unless ``sort_keys``. Written
    piece by piece and bounded: an indentation or separator is repeated once per line or item,
    so each is at most MAX_JSON_SPACING characters, and the text at most MAX_VALUE_SIZE."""
    if isinstance(value, Iterator):
        value = list(value)
    spacing = [indent if isinstance(indent, int) else len(str(indent or ""))]
    seps = None if separators is None else (str(separators[0]), str(separators[1]))
    spacing += [len(sep) for sep in seps or ()]
    if max(spacing) > MAX_JSON_SPACING:
        raise TemplateError(
            f"the chat template's tojson has an indentation or separator of {max(spacing)} "
            f"characters, over the limit of {MAX_JSON_SPACING}"
        )
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=seps,
                               sort_keys=sort_keys, default=_json_default)  # fmt: skip
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        _refuse_size(size, "a JSON text")
        pieces.append(piece)
    return "".join(pieces)


def _from_json(text: str) -> Any:
    """llama.cpp's ``from_json`` filter (DeepSeek's templates): JSON text to a value."""
    _refuse_size(len(str(text)), "a JSON text")
    try:
        return json.loads(str(text))
    except json.JSONDecodeError as error:
        raise TemplateError(f"the chat template's from_json got invalid JSON: {error}") from None


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: Hugging Face marks the assistant's part of a
    rendering with it (for training masks); for a prompt the body renders as it is."""

    tags = {"generation"}  # noqa: RUF012 (Jinja reads it per class)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _size(value: Any) -> int:
    """Characters of a string (bytes of bytes); items of a list or tuple plus the characters
    of the strings in it (a list of one long string repeated is as large as the string
    repeated); else 1."""
    if isinstance(value, _TEXT):
        return len(value)
    if isinstance(value, (list, tuple)):
        total = len(value)
        for item in value:
            total += len(item) if isinstance(item, _SEQUENCE) else 0
            if total > MAX_VALUE_SIZE:
                break
        return total
    return 1


def _refuse_size(size: int, what: str) -> None:
    if size > MAX_VALUE_SIZE:
        raise TemplateError(
            f"the chat template built {what} of about {size} characters or items, over the limit "
            f"of {MAX_VALUE_SIZE} (llamacrab._chat.template.MAX_VALUE_SIZE)"
        )


def _refuse_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateError(
            f"the chat template computed an integer of about {bits} bits, over the limit of "
            f"{MAX_INT_BITS} bits (llamacrab._chat.template.MAX_INT_BITS)"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int)


_TEXT = (str, bytes, bytearray)  # ``.encode()`` gives a template bytes, with str's methods
_SEQUENCE = (*_TEXT, list, tuple)
# A %-conversion's width and precision: digits, or * (taken from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(template: str, args: Any) -> None:
    """Widths and precisions in ``template % args``: ``'%999999999d' % 1`` is a gigabyte; and
    ``'%(a)s' * 1000 % {'a': long}`` writes one value a thousand times."""
    star = False
    fields = _PERCENT_SPEC.findall(template)
    for width, precision in fields:
        for number in (width, precision):
            star = star or number == "*"
            if (size := decimal(number)) is not None:
                _refuse_size(size, "a formatted field")
    values = list(args.values()) if isinstance(args, Mapping) else args
    values = values if isinstance(values, (tuple, list)) else [values]
    if star:
        for value in values:
            if _is_int(value):
                _refuse_size(abs(value), "a formatted field")
    _refuse_size(len(template) + len(fields) * _longest(values), "a formatted string")


def _longest(values: Iterable[Any]) -> int:
    """The longest text any of ``values`` formats to (what a field may write)."""
    return max((len(value) if isinstance(value, _TEXT) else len(str(value)) for value in values),
               default=0)  # fmt: skip


def _check_format(template: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """``str.format``: ``'{:>3000000000}'.format('a')`` is gigabytes in one step; a width in a
    nested field (``'{:{}}'``) cannot be read before it runs, so it is refused."""
    try:
        fields = [
            spec for _, name, spec, _ in string.Formatter().parse(template) if name is not None
        ]
    except ValueError as error:
        raise TemplateError(f"the chat template's format string is invalid: {error}") from None
    for spec in fields:
        if "{" in (spec or ""):
            raise TemplateError("the chat template nests a field in a format spec: "
                                f"{template[:80]!r}")  # fmt: skip
        for number in re.findall(r"\d+", spec or ""):
            _refuse_size(int(number), "a formatted field")
    longest = _longest([*args, *kwargs.values()])
    _refuse_size(len(template) + len(fields) * longest, "a formatted string")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        if _is_int(left) and _is_int(right):
            _refuse_bits(abs(left).bit_length() + abs(right).bit_length())
        elif isinstance(left, _SEQUENCE) and _is_int(right):
            _refuse_size(_size(left) * max(right, 0), "a repeated sequence")
        elif _is_int(left) and isinstance(right, _SEQUENCE):
            _refuse_size(_size(right) * max(left, 0), "a repeated sequence")
    elif op == "+":
        if isinstance(left, _SEQUENCE) and isinstance(right, _SEQUENCE):
            _refuse_size(_size(left) + _size(right), "a concatenation")
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            _refuse_bits(abs(left).bit_length() * right)
    elif op == "%" and isinstance(left, _TEXT):
        _check_percent(left if isinstance(left, str) else left.decode("latin-1"), right)


def _checked_join(sequence: Any, separator: str | bytes | bytearray) -> None:
    items = list(sequence)
    _refuse_size(sum(_size(i) for i in items) + len(separator) * len(items), "a joined string")


def _checked_replace(value: Any, old: Any, new: Any, count: Any = -1) -> None:
    kinds = {type(value), type(old), type(new)}
    if len(kinds) == 1 and kinds <= set(_TEXT):
        found = value.count(old) if old else len(value) + 1
        if _is_int(count) and count >= 0:
            found = min(found, count)
        _refuse_size(len(value) + found * max(len(new) - len(old), 0), "a replaced string")


def _guard_filters(env: jinja2.Environment) -> None:
    """The filters that build a large value in one step, with a size check first."""

    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        if attribute is None:
            _checked_join(items, str(d))
        joined: str = FILTERS["join"](eval_ctx, items, d, attribute)
        return joined

    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> str:
        _checked_replace(str(s), str(old), str(new), -1 if count is None else count)
        replaced: str = FILTERS["replace"](eval_ctx, s, old, new, count)
        return replaced

    def center(value: Any, width: int = 80) -> str:
        if _is_int(width):
            _refuse_size(width, "a centred string")
        return str(FILTERS["center"](value, width))

    def indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        lines = str(s).count("\n") + 1
        each = width if _is_int(width) else len(str(width))
        _refuse_size(len(str(s)) + lines * each, "an indented string")
        return str(FILTERS["indent"](s, width, first, blank))

    def format_(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_percent(str(value), kwargs or args)
        return str(FILTERS["format"](value, *args, **kwargs))

    def sum_(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        items = list(iterable)
        if isinstance(start, _SEQUENCE):
            _refuse_size(_size(start) + sum(_size(i) for i in items), "a sum")
        return FILTERS["sum"](environment, items, attribute, start)

    for name, function in (("replace", replace), ("join", join)):
        setattr(function, "jinja_pass_arg", FILTERS[name].jinja_pass_arg)  # noqa: B010
    setattr(sum_, "jinja_pass_arg", FILTERS["sum"].jinja_pass_arg)  # noqa: B010
    env.filters.update(join=join, replace=replace, center=center, indent=indent,
                       format=format_, sum=sum_)  # fmt: skip


def _check_str_method(method: BuiltinFunctionType, args: tuple[Any, ...]) -> None:
    """``'x'.ljust(10**9)`` and the like (of bytes too), refused before they run."""
    target, name = method.__self__, method.__name__
    if not isinstance(target, _TEXT) or not args:
        return
    if name == "translate" and isinstance(args[0], Mapping):
        _refuse_size(len(target) * _longest(args[0].values()), "a translated string")
    elif name in ("ljust", "rjust", "center", "zfill") and _is_int(args[0]):
        _refuse_size(args[0], "a padded string")
    elif name == "expandtabs" and _is_int(args[0]):
        tabs = target.count("\t") if isinstance(target, str) else target.count(b"\t")
        _refuse_size(len(target) + tabs * max(args[0], 0), "an expanded string")
    elif name == "join":
        _checked_join(args[0], target)
    elif name == "replace" and len(args) >= 2:
        _checked_replace(target, args[0], args[1], args[2] if len(args) > 2 else -1)


# Lists and dicts a template may not change: ``id()`` of every one reachable from the variables
# of the rendering in progress (they stay alive while it runs, so no other object has their id).
_FROZEN: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "llamacrab_template_frozen", default=frozenset()
)
# The mutating methods a template may call on values it built itself; they are size-checked.
_GROWING = frozenset({"append", "insert", "extend", "update", "setdefault", "add"})


def _container_ids(value: Any, found: set[int]) -> None:
    """``id()`` of ``value`` and of every list, dict or set inside it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, dict, set)) and id(item) not in found:
            found.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
        elif isinstance(item, tuple):
            stack.extend(item)


def _check_mutation(target: Any, name: str, args: tuple[Any, ...]) -> None:
    """Growing a list, dict or set: refused past MAX_VALUE_SIZE items."""
    if name in ("append", "insert", "setdefault", "add"):
        _refuse_size(len(target) + 1, "a grown container")
    elif name in ("extend", "update") and args:
        added = args[0]
        size = len(added) if isinstance(added, (Sequence, Mapping, set)) else MAX_VALUE_SIZE + 1
        _refuse_size(len(target) + size, "a grown container")


def _blank(value: Any) -> bool:
    return value is None or isinstance(value, Undefined)


class _Generator(CodeGenerator):
    """Compiles ``~`` to the sandbox's checked join, so that one concatenation is bounded like
    ``+`` (a loop doubling a string through a namespace grew without bound)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(SandboxedEnvironment):
    """Jinja's sandbox quietly renders an unsafe attribute as undefined; a template reaching for
    Python internals is hostile or broken either way, so it is an error here. Operators that
    can build a huge value in one step are checked first (see the module's docstring). The
    values passed in are immutable (as in Jinja's ImmutableSandboxedEnvironment); what the
    template built itself is not."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _Generator

    def checked_concat(self, values: tuple[Any, ...]) -> str:
        parts = [str(value) for value in values]
        _refuse_size(sum(map(len, parts)), "a concatenation")
        return "".join(parts)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if not super().is_safe_attribute(obj, attr, value):
            return False
        if not modifies_known_mutable(obj, attr):
            return True
        return attr in _GROWING | {"pop", "remove", "clear", "popitem", "discard", "sort",
                                   "reverse"} and id(obj) not in _FROZEN.get()  # fmt: skip

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Jinja's own str.format / format_map, with the widths and fields checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template, mapped = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            if mapped:
                mapping = args[0] if len(args) == 1 and isinstance(args[0], Mapping) else {}
                _check_format(template, (), mapping)
            else:
                _check_format(template, args, kwargs)
            return wrapped(*args, **kwargs)

        return checked

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and (
            (_blank(left) and isinstance(right, str)) or (isinstance(left, str) and _blank(right))
        ):
            # llama.cpp's engine: a missing side of a string concatenation is empty.
            return ("" if _blank(left) else left) + ("" if _blank(right) else right)
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(__obj, BuiltinFunctionType):
            target = __obj.__self__
            if isinstance(target, _TEXT):
                if __obj.__name__ == "join" and args:
                    args = (list(args[0]), *args[1:])  # an iterator is read once: check a list
                _check_str_method(__obj, args)
            elif isinstance(target, (list, dict, set)) and __obj.__name__ in _GROWING:
                counted = isinstance(args[0], (Sequence, Mapping, set)) if args else True
                if __obj.__name__ in ("extend", "update") and not counted:
                    args = (list(args[0]), *args[1:])  # an iterator: count it first
                _check_mutation(target, __obj.__name__, args)
        return super().call(__context, __obj, *args, **kwargs)


def _environment() -> SandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, undefined=ChainableUndefined,
                   extensions=["jinja2.ext.loopcontrols", _Generation])  # fmt: skip
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = _from_json
    _guard_filters(env)
    return env


_ENV = _environment()


class TemplateTimeout(TemplateError):
    """A template ran past MAX_SECONDS."""


class _Deadline:
    """A trace function that stops template code running past its time budget."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > self.deadline:
            raise TemplateTimeout(f"the chat template ran longer than {MAX_SECONDS} s")
        return self


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    /,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """The prompt text ``source`` makes of ``messages`` (the usual Hugging Face variables)."""
    try:
        template = _ENV.from_string(source)
    except jinja2.TemplateError as error:
        raise TemplateError(f"the chat template does not parse: {error}") from error
    except (RecursionError, MemoryError, SyntaxError) as error:
        # Nested too deep for Jinja's recursive parser, or for Python to compile what Jinja
        # made of it (Python allows 100 levels of indentation).
        raise TemplateError(
            f"the chat template does not compile: {type(error).__name__}: {error}"
        ) from error
    variables = {
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": list(tools) if tools else None,
        "documents": list(documents) if documents else None,
        **extra,
    }
    frozen: set[int] = set()
    _container_ids(variables, frozen)
    pieces: list[str] = []
    size = 0
    previous = sys.gettrace()
    token = _FROZEN.set(frozenset(frozen))
    sys.settrace(_Deadline(MAX_SECONDS))
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateError(
                    f"the chat template produced more than {MAX_OUTPUT_CHARS} chars"
                )
            pieces.append(piece)
    except TemplateError:
        raise
    except SecurityError as error:
        raise TemplateError(f"the chat template tried something unsafe: {error}") from error
    except Exception as error:  # a template is code from a file: any failure is its failure
        raise TemplateError(f"the chat template failed: {type(error).__name__}: {error}") from error
    finally:
        sys.settrace(previous)
        _FROZEN.reset(token)
    return "".join(pieces)
