"""The chat-template sandbox: jinja's immutable sandbox with a hook wherever a template can loop, call or build, each
spending the budget open on its thread (webchat.text.template_budget).

    for x in xs        → xs wrapped at compile time (count_items): a step per item; a recursive loop's loop(ys) too
    a * n, a + b, a % b, a ** n, a ~ b  → the size of what they build, before it is built
    filters, tests     → a step each (a step per item where their Python work grows with the value: sort, map, ...),
                         the predicted size first (PREDICT: center, indent, format, replace, wordwrap, join, batch,
                         slice, string, pprint, list, tojson), the result's size after
    str methods        → center, ljust, rjust, zfill, expandtabs, replace, join sized before; str.format's fields by
                         their widths and values
    {{ x }}            → finalize: x shown as text, its size (containers walked) spent first
    a macro's output   → concat: the output budget, then the characters
Constant folding is off (optimized=False, a finalize that needs the context): `''|center(10**9)` would otherwise run
at compile time, outside any budget.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from string import Formatter
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import _PassArg
from markupsafe import Markup

from webchat.text.template_budget import (
    as_text,
    build,
    built,
    chars_left,
    check_output,
    exhausted,
    spend,
    step,
    text_size,
)

MAX_RANGE = 100_000  # items of one range(), as jinja's sandbox
MAX_EXPONENT = 256  # `a ** b`: |b| at most this
MAX_INT_BITS = 1 << 16  # an integer a template computes with * or **
MAX_JSON_INDENT = 16


_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")


def printf_size(fmt: str, args: Any) -> int:
    """An upper bound of len(fmt % args): each conversion's width, precision and argument."""
    limit = chars_left()
    values = list(args) if isinstance(args, tuple) else [args]
    total = len(fmt)
    for key, width, precision, kind in _PRINTF.findall(fmt):
        for spec in (width, precision):
            if spec == "*":
                n = values.pop(0) if values else 0
                total += abs(n) if isinstance(n, int) else 0
            elif spec:
                total += int(spec) if len(spec) < 19 else 1 << 62
        if kind == "%":
            continue
        if key and isinstance(args, dict):
            arg = args.get(key)
        else:
            arg = values.pop(0) if values else None
        total += text_size(arg, limit) if kind in "rsa" else 32
    return total


SEQUENCES = (str, list, tuple)


def binop(operator: str, left: Any, right: Any) -> bool:
    """Spend what `left <operator> right` builds, before it is built; False when its size is to be counted after."""
    step()
    if operator == "+":  # the commonest: a template gluing its markers to the contents
        if isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
            build(len(left) + len(right), "a concatenation")
            return True
        return False
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, SEQUENCES) and isinstance(count, int):
                build(len(seq) * max(count, 0), "a repeated sequence")
                return True
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise exhausted(f"multiplied integers of {left.bit_length()} and {right.bit_length()} bits; at most "
                            f"{MAX_INT_BITS} bits are allowed")
    elif operator == "**" and isinstance(right, int | float):
        if abs(right) > MAX_EXPONENT:
            raise exhausted(f"computed x ** {right}; allowed exponents are at most {MAX_EXPONENT}")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() * max(right, 0) > MAX_INT_BITS:
            raise exhausted(f"computed an integer of about {left.bit_length() * right} bits; at most {MAX_INT_BITS} "
                            "bits are allowed")
    elif operator == "%" and isinstance(left, str):
        build(printf_size(left, right), "a %-formatted string")
        return True
    return False


def join_pieces(pieces: Iterable[Any]) -> str:
    """`a ~ b ~ c`: every piece as text, the total spent before it is joined."""
    texts = [as_text(p) for p in pieces]
    build(sum(len(t) for t in texts), "a ~ concatenation")
    return "".join(texts)


def concat(pieces: Iterable[str]) -> str:
    """A macro's, a block's or a filter block's output joined: the output budget, then the characters."""
    items = list(pieces)
    n = sum(len(p) for p in items)
    check_output(n)
    build(n, "a block's output")
    return "".join(items)


@jinja2.pass_eval_context  # a finalize that needs a context is never run at compile time (no constant folding)
def finalize(eval_ctx: Any, value: Any) -> str:
    """Each `{{ value }}`: shown as text, its size spent before it is built."""
    return as_text(value)


class _Counted:
    """A for loop's iterable: a step per item; its length is the iterable's (loop.length, loop.last)."""

    __slots__ = ("_items",)

    def __init__(self, items: Any) -> None:
        self._items = items

    def __iter__(self) -> Iterator[Any]:
        for item in self._items:
            step()
            yield item

    def __len__(self) -> int:
        return len(self._items)


def count_items(items: Any) -> _Counted:
    return _Counted(items)


def budget_range(*args: int) -> range:
    """range() of at most MAX_RANGE items (a loop over it spends a step per item)."""
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise exhausted(f"asked for range{args}: {len(rng)} items; at most {MAX_RANGE} are allowed")
    return rng


# ---------------------------------------------------------------- filters, methods, str.format
def _width(n: Any) -> int:
    return n if isinstance(n, int) else len(n) if isinstance(n, str) else 0


def _replace_size(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if not isinstance(s, str) or not isinstance(old, str) or not isinstance(new, str):
        return 0
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _join_size(items: list[Any], sep: Any = "") -> int:
    """len(sep.join(str(x) for x in items)), stopping once past what may still be built."""
    limit, total = chars_left(), len(str(sep)) * max(len(items) - 1, 0)
    for x in items:
        total += len(x) if isinstance(x, str) else text_size(x, limit - total)
        if total > limit:
            break
    return total


def json_indent(indent: Any) -> int:
    """tojson's indent, at most MAX_JSON_INDENT (json.dumps builds the indent string first, whatever its size)."""
    width = _width(indent) if indent is not None else 0
    if width > MAX_JSON_INDENT:
        raise exhausted(f"asked tojson for an indent of {width}; at most {MAX_JSON_INDENT} is allowed")
    return width


def _sized(value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        return 0


# filter name -> what it builds, from (value, *args) before it runs; None: what it returns is counted after
PREDICT: dict[str, Callable[..., int]] = {
    "center": lambda v, width=80: max(_width(width), len(str(v)) if isinstance(v, str) else 0),
    "indent": lambda s, width=4, *a, **k: _sized(s) + (str(s).count("\n") + 1) * _width(width),
    "format": lambda v, *args, **kw: printf_size(str(v), kw or args),
    "replace": lambda s, old, new, count=None: _replace_size(s, old, new, count),
    "wordwrap": lambda s, width=79, brk=True, wrapstring=None, *a, **k: 2 * _sized(s) * (1 + len(wrapstring or "\n")),
    "batch": lambda v, linecount, *a: max(linecount, 0) if isinstance(linecount, int) else 0,
    "slice": lambda v, slices, *a: max(slices, 0) if isinstance(slices, int) else 0,
    "string": lambda v: text_size(v, chars_left()) if not isinstance(v, str) else 0,
    "pprint": lambda v, *a: text_size(v, chars_left()),
    "list": lambda v: _sized(v),
    "tojson": lambda v, *a, indent=None, **k: text_size(v, chars_left()) * (1 + json_indent(indent)),
}
# filters whose Python-level work grows with the value's length: a step per item or character
PER_ITEM = {"sort", "dictsort", "groupby", "unique", "urlize", "wordwrap", "title", "xmlattr", "striptags", "sum",
            "min", "max", "wordcount", "map", "select", "reject", "selectattr", "rejectattr", "batch", "slice"}


def guard_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The filter, spending a step (a step per item for PER_ITEM), its predicted size first and its result's after."""
    skip = 1 if _PassArg.from_obj(fn) is not None else 0  # a context/environment argument comes first
    predict = PREDICT.get(name)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        step()
        value = args[skip] if len(args) > skip else None
        if name in PER_ITEM:
            step(_sized(value))
        if name == "join" and value is not None:
            items = list(value)
            build(_join_size(items, args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")), "a join")
            return fn(*args[:skip], items, *args[skip + 1:], **kwargs)
        if predict is not None and len(args) > skip:
            try:
                size = predict(*args[skip:], **kwargs)
            except TypeError:  # called wrongly: the filter itself says how
                return fn(*args, **kwargs)
            build(size, f"the output of the {name!r} filter")
            return fn(*args, **kwargs)
        return built(fn(*args, **kwargs))

    return guarded


def guard_test(fn: Any) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        step()
        return fn(*args, **kwargs)

    return guarded


# str methods a template may call, and what they build, from (the string, *args)
STR_METHODS: dict[str, Callable[..., int]] = {
    "center": lambda s, width=0, *a: max(_width(width), len(s)),
    "ljust": lambda s, width=0, *a: max(_width(width), len(s)),
    "rjust": lambda s, width=0, *a: max(_width(width), len(s)),
    "zfill": lambda s, width=0: max(_width(width), len(s)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(_width(tabsize), 0),
    "replace": lambda s, old, new, count=-1: _replace_size(s, old, new, count),
    "join": lambda s, items: 0,  # sized in call() once the items are listed
}


def method_size(obj: Any, args: tuple[Any, ...]) -> tuple[int, tuple[Any, ...]]:
    """(characters a bound str method will build, its arguments with an iterable listed)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str) or name not in STR_METHODS:
        return 0, args
    if name == "join" and args:
        items = list(args[0])
        return _join_size(items, owner), (items, *args[1:])
    try:
        return STR_METHODS[name](owner, *args), args
    except TypeError:
        return 0, args  # a wrong call: the method itself says so


class BudgetFormatter(SandboxedFormatter):
    """str.format in the sandbox: each field's width and precision, and its value as text, spent before it is built."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        step()
        numbers = [int(n) if len(n) < 19 else 1 << 62 for n in re.findall(r"\d+", format_spec)]
        limit = chars_left()
        build(sum(numbers) + text_size(value, limit), "a str.format field")
        return built(Formatter.format_field(self, value, format_spec))


class _Codegen(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.join_pieces((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, every render under the budget open on its thread (see the module's docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _Codegen

    def __init__(self, **options: Any) -> None:
        # optimized=False: no constant folding, which would run `''|center(10**9)` at compile time, outside a budget
        super().__init__(finalize=finalize, optimized=False, **options)
        self.globals["range"] = budget_range
        self.globals.pop("lipsum", None)  # n paragraphs of up to max words, in one call
        self.filters = {name: guard_filter(name, fn) for name, fn in self.filters.items()}
        self.tests = {name: guard_test(fn) for name, fn in self.tests.items()}

    join_pieces = staticmethod(join_pieces)
    count_items = staticmethod(count_items)
    concat = staticmethod(concat)

    def add_filter(self, name: str, fn: Callable[..., Any]) -> None:
        self.filters[name] = guard_filter(name, fn)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Parse, then wrap every for loop's iterable so that each item it yields spends a step."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("count_items"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        return tree

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # the hot path, in one call
            spend(1, len(left) + len(right), "a concatenation")
            return left + right
        sized = binop(operator, left, right)
        out = super().call_binop(context, operator, left, right)
        return out if sized else built(out)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's loop(children): its items spend steps too
            args = (count_items(args[0]), *args[1:])
        size, args = method_size(__obj, args)
        if size:
            build(size, f"the result of str.{getattr(__obj, '__name__', '?')}")
        out = super().call(__context, __obj, *args, **kwargs)
        return out if size else built(out)

    def getattr(self, obj: Any, attribute: str) -> Any:
        step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        step()
        value = super().getitem(obj, argument)
        return built(value) if isinstance(argument, slice) else value

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None or not isinstance(value.__self__, str) or isinstance(value.__self__, Markup):
            return wrapper
        formatter = BudgetFormatter(self)
        f_self, is_map = value.__self__, value.__name__ == "format_map"

        def budgeted(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument and no keywords")
                kwargs, args = args[0], ()
            return str(formatter.vformat(f_self, args, kwargs))

        return budgeted
