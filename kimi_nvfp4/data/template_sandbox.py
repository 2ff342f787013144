"""A Jinja sandbox with a budget: chat templates are untrusted data, so rendering one is bounded.

`ImmutableSandboxedEnvironment` keeps a template away from Python internals, but not from the CPU
or the memory: `{% for i in range(100000) %}{% for j in range(100000) %}…` loops for hours, and
`{{ 9 ** (9 ** 9) }}` is evaluated while the template *compiles* (Jinja folds constant
expressions). `BoundedSandbox` adds what a server needs to survive such a template:

- jinja's own `range` limit (`jinja2.sandbox.MAX_RANGE` items per call) stays;
- `**`, `*`, `+` and `%` are intercepted (which also stops constant folding of them at compile
  time) and refused before they compute an integer wider than `MAX_INT_BITS` or a string/list
  longer than `MAX_RENDERED_CHARS`; so are `~` joins, filters and calls (integer arguments,
  format widths and result sizes);
- the rendered text is streamed and stops at `MAX_RENDERED_CHARS`;
- a wall-clock budget (`RENDER_TIME_BUDGET_S`) covers compiling and rendering: a watchdog thread
  raises `_RenderDeadline` inside the rendering thread when it runs out (CPython delivers such an
  asynchronous exception between bytecodes, so any template loop stops; the size guards keep the
  C-level operations between bytecodes short).

A template that hits a limit raises `TemplateBudgetExceeded`; `ChatTemplate` turns it into a
`ChatTemplateError` naming the template file.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Longest text a template may produce, and longest string/list it may build on the way. A 262k-token
# context is about 1M characters; 8M leaves room for sessions rendered whole and windowed later.
MAX_RENDERED_CHARS = 8 * 1024 * 1024
# Widest integer `**` or `*` may produce: a template counts tool calls and indexes lists.
MAX_INT_BITS = 4096
# Wall-clock budget for compiling or rendering one template (a real one renders a 100k-token prompt
# in milliseconds).
RENDER_TIME_BUDGET_S = 10.0
# printf widths/precisions ("%99999999d") and str.format specs ("{:>99999999}") allocate before
# any result size can be checked.
_PRINTF_WIDTHS = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?")
_FORMAT_SPEC_NUMBERS = re.compile(r"\{[^{}]*:([^{}]*)\}")
_DIGITS = re.compile(r"\d+")

T = TypeVar("T")


class TemplateBudgetExceeded(Exception):
    """A template went past a rendering limit (time, output size, integer or string size)."""


class _RenderDeadline(BaseException):
    """Raised asynchronously in the rendering thread by the watchdog.

    A BaseException, so no `except Exception` inside Jinja or a template helper swallows it.
    """


def _refuse(what: str) -> None:
    raise TemplateBudgetExceeded(what)


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDERED_CHARS:
        _refuse(f"built a {type(value).__name__} of {len(value):,} items (limit {MAX_RENDERED_CHARS:,})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        _refuse(f"built a {value.bit_length():,}-bit integer (limit {MAX_INT_BITS} bits)")
    return value


def _check_int_args(args: Iterable[Any]) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDERED_CHARS:
            _refuse(f"passed {a:,} to a call or filter (limit {MAX_RENDERED_CHARS:,})")


def _check_format_string(fmt: str, *, printf: bool) -> None:
    numbers = ([n for m in _PRINTF_WIDTHS.finditer(fmt) for n in m.groups() if n] if printf
               else [n for spec in _FORMAT_SPEC_NUMBERS.findall(fmt) for n in _DIGITS.findall(spec)])
    for n in numbers:
        if int(n) > MAX_RENDERED_CHARS:
            _refuse(f"format width {int(n):,} (limit {MAX_RENDERED_CHARS:,})")


def _guard_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse before computing what would be too large (Python would allocate it first)."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            _refuse(f"{left} ** {right} is wider than {MAX_INT_BITS} bits")
    elif operator == "*":
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            _refuse(f"a product wider than {MAX_INT_BITS} bits")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDERED_CHARS:
                _refuse(f"repeating a {type(seq).__name__} of {len(seq):,} items {n:,} times "
                        f"(limit {MAX_RENDERED_CHARS:,})")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_RENDERED_CHARS:
            _refuse(f"concatenating to {len(left) + len(right):,} items (limit {MAX_RENDERED_CHARS:,})")
    elif operator == "%" and isinstance(left, str):
        _check_format_string(left, printf=True)


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps `jinja_pass_arg` (pass_context/pass_environment) in __dict__
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_int_args(itertools.chain(args, kwargs.values()))
        if f.__name__ == "do_format" and args and isinstance(args[0], str):
            _check_format_string(args[0], printf=True)
        return _check_size(f(*args, **kwargs))
    return wrapper


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to `str_join((a, b))`, which no sandbox hook sees; route it through one."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if self.optimizer is not None and not frame.eval_ctx.volatile:
            folded = self.optimizer.visit(node, frame.eval_ctx)  # constants only: bounded by the source
            if folded is not node:
                self.visit(folded, frame)
                return
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox plus the limits in this module's docstring."""

    intercepted_binops = frozenset({"**", "*", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        # lipsum(n=10**9) would be a bomb; no chat template uses it
        self.globals.pop("lipsum", None)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _guard_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_int_args(itertools.chain(args, kwargs.values()))
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            _check_format_string(fmt, printf=False)
            _check_int_args(itertools.chain(args, kwargs.values()))
            return _check_size(wrapped(*args, **kwargs))
        return bounded

    @staticmethod
    def bounded_concat(parts: Iterable[Any]) -> str:
        texts = [str(p) for p in parts]
        if sum(map(len, texts)) > MAX_RENDERED_CHARS:
            _refuse(f"joining to more than {MAX_RENDERED_CHARS:,} characters")
        return "".join(texts)


def collect_output(chunks: Iterable[str]) -> str:
    """Join a template's streamed output, stopping as soon as it passes MAX_RENDERED_CHARS."""
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            _refuse(f"rendered more than {MAX_RENDERED_CHARS:,} characters")
        out.append(chunk)
    return "".join(out)


class _Watchdog:
    """One daemon thread that interrupts renders past their deadline.

    `arm()` registers the calling thread with a deadline; when it passes, the watchdog raises
    `_RenderDeadline` in that thread (`PyThreadState_SetAsyncExc`). `disarm()` unregisters it and
    clears an interrupt that was raised but not yet delivered, both under one lock, so a render
    that ends just as its deadline passes is never interrupted afterwards.
    """

    def __init__(self) -> None:
        # A plain (C) lock under the condition: `disarm` enters it directly with `with`, never through
        # Condition.__enter__, whose Python frame an interrupt landing right after the acquire would
        # leave holding the lock for good.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, key)
        self._active: dict[int, int] = {}  # key -> thread ident
        self._fired: set[int] = set()
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> int:
        # no interrupt can be pending for this thread here: the previous render's disarm cleared it
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="template-watchdog", daemon=True)
                self._thread.start()
            key = next(self._keys)
            self._active[key] = threading.get_ident()
            heapq.heappush(self._deadlines, (time.monotonic() + seconds, key))
            self._cv.notify()
            return key

    def disarm(self, key: int) -> None:
        # the only watchdog code that runs while this thread's interrupt may be pending
        with self._lock:
            ident = self._active.pop(key, None)
            if key in self._fired:
                self._fired.discard(key)
                if ident is not None:
                    _set_async_exc(ident, None)

    def _loop(self) -> None:
        with self._cv:
            while True:
                while self._deadlines and self._deadlines[0][1] not in self._active:
                    heapq.heappop(self._deadlines)
                if not self._deadlines:
                    self._cv.wait()
                    continue
                deadline, key = self._deadlines[0]
                now = time.monotonic()
                if now < deadline:
                    self._cv.wait(deadline - now)
                    continue
                heapq.heappop(self._deadlines)
                self._fired.add(key)
                _set_async_exc(self._active[key], _RenderDeadline)


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


_WATCHDOG = _Watchdog()


def within_budget(fn: Callable[[], T], seconds: float = RENDER_TIME_BUDGET_S) -> T:
    """`fn()` with a wall-clock budget; past it, TemplateBudgetExceeded instead of a hang."""
    key = _WATCHDOG.arm(seconds)
    try:
        try:
            return fn()
        finally:
            _WATCHDOG.disarm(key)
    except _RenderDeadline:
        _WATCHDOG.disarm(key)  # the interrupt may have landed inside the first disarm
        raise TemplateBudgetExceeded(f"ran longer than {seconds:g} s") from None
    except RecursionError:
        raise TemplateBudgetExceeded("recursed too deeply (a macro calling itself?)") from None
