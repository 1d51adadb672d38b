"""Issue 42, rows 5 to 7 in-process: a chat template's steps (loop iterations included), the characters it builds
(filters and operators sized before they run), its output and its time are budgets a runaway cannot slip past; real
templates render exactly as jinja's own sandbox renders them, well within those budgets."""

from __future__ import annotations

import resource
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from webchat.text import template_budget as tb
from webchat.text.tokenizer import _GenerationTag, _raise_exception, _tojson, render_chat_template

pytestmark = pytest.mark.timeout(120)
FIXTURES = Path(__file__).parents[1] / "fixtures" / "templates"
NINE_LOOPS = "{% set xs = range(10) %}" + "".join(f"{{% for a{i} in xs %}}" for i in range(9)) + "{% endfor %}" * 9

# (name, template): each would build gigabytes, or loop ~forever, or recurse, without the budgets
HOSTILE = [
    ("nine nested loops, no calls (row 5)", NINE_LOOPS),
    ("center padding (row 6)", "{{ ''|center(1500000000) }}"),
    ("format filter padding", "{{ '%1500000000s'|format('') }}"),
    ("% padding", "{{ '%1500000000s' % '' }}"),
    ("% padding from *", "{{ '%*s' % (1500000000, '') }}"),
    ("* repeat", "{{ 'x' * 1500000000 }}"),
    ("~ doubling 40 times (row 7)", "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"),
    ("+ doubling", "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"),
    ("+ list doubling", "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}"),
    ("nested range (row 7)", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    ("join of one big string 1000 times", "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join }}"),
    ("indent", "{{ ('a\\n' * 100000)|indent(100000) }}"),
    ("replace", "{{ ('a' * 1000000)|replace('a', 'b' * 100) }}"),
    ("str.ljust", "{{ ''.ljust(1500000000) }}"),
    ("str.join", "{% set s = 'x' * 1000000 %}{{ ''.join([s] * 1000) }}"),
    ("str.expandtabs", "{{ ('\\t' * 1000).expandtabs(10000000) }}"),
    ("str.format width", "{{ '{:>1500000000}'.format('') }}"),
    ("str.format nested width", "{{ '{:>{w}}'.format('', w=1500000000) }}"),
    ("wordwrap", "{{ ('ab ' * 3000000)|wordwrap(1) }}"),
    ("tojson indent", "{{ [1]|tojson(indent=1000000000) }}"),
    ("batch fill", "{{ [1]|batch(1500000000, 'x')|list|length }}"),
    ("a list shown as text", "{% set s = 'x' * 1000000 %}{{ [s] * 1000 }}"),
    ("a macro's buffered output", "{% macro m(s) %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}"
                                  "{% set s = 'x' * 1000000 %}{{ m(s)|length }}"),
    ("macro recursion", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"),
    ("recursive loop", "{% for x in [1] recursive %}{{ loop([1, 1]) }}{% endfor %}"),
    ("sort of a long list", "{{ ('x' * 8000000)|list|sort|length }}"),
    ("integer squaring", "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                         "{% endfor %}"),
    ("a huge range", "{{ range(10**9)|length }}"),
]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(("name", "source"), HOSTILE, ids=[n for n, _ in HOSTILE])
def test_a_runaway_template_ends_in_a_named_budget_error_fast_and_small(name: str, source: str) -> None:
    peak, t0 = rss_mb(), time.monotonic()
    with pytest.raises(tb.TemplateBudgetError) as err:
        render_chat_template(source, [])
    took = time.monotonic() - t0
    message = str(err.value)
    assert message.startswith("the chat template ") and any(
        w in message for w in ("budget", "at most", "deeper")), message
    assert took < tb.FULL.seconds, (name, took)  # the steps or the characters ran out first, not the clock
    assert rss_mb() - peak < 300, (name, rss_mb() - peak)  # nothing of gigabytes was ever built


def test_loop_iterations_are_steps_without_any_call() -> None:
    """Row 5: no call, attribute or filter in the loops: only the iterations can stop it (the old budget was
    checked at calls only and never fired)."""
    source = "".join(f"{{% for a{i} in xs %}}" for i in range(4)) + "{% endfor %}" * 4
    small = replace(tb.FULL, steps=10_000)
    with tb.budget(small), pytest.raises(tb.TemplateBudgetError, match="step budget of 10000 steps"):
        render_chat_template(source, [], xs=list(range(11)))  # 11^4 = 14641 iterations
    with tb.budget(small):
        render_chat_template(source, [], xs=list(range(9)))  # 9^4 = 6561: within it


def test_filters_are_sized_before_they_run() -> None:
    """Row 6: the padding is refused before it is built (the old limit was checked on the finished piece)."""
    small = replace(tb.FULL, chars=1000)
    with tb.budget(small):
        assert render_chat_template("{{ 'ab'|center(900) }}", []).strip() == "ab"
    with tb.budget(small), pytest.raises(tb.TemplateBudgetError, match="would build .* of 1100 characters"):
        render_chat_template("{{ 'ab'|center(1100) }}", [])


def plain(source: str, variables: dict[str, Any]) -> str:
    """jinja's own immutable sandbox, configured as webchat's, without budgets: the reference rendering."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: "26 Nov 2026"
    return env.from_string(source).render(**variables)


def chat(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are helpful."}]
    for i in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}: tell me about the sea. " * 3},
                 {"role": "assistant", "content": f"Answer {i}: the sea is wide. " * 3}]
    return [*msgs, {"role": "user", "content": "And the sky?"}]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.jinja")), ids=lambda p: p.stem)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_real_templates_render_as_jinja_does_within_a_fraction_of_the_budget(path: Path, tools: Any,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import webchat.text.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "_strftime_now", lambda fmt: "26 Nov 2026")
    tokenizer.compile_chat_template.cache_clear()
    source, messages = path.read_text(), chat(50)
    extra = {"bos_token": "<s>", "eos_token": "</s>", "tools": tools}
    try:
        want = plain(source, {"messages": messages, "add_generation_prompt": True, "documents": None, **extra})
    except TypeError as exc:  # a tool-use-only template (Hermes 3's) loops over tools: None is an error in both
        with tb.budget(tb.FULL), pytest.raises(TypeError, match=str(exc)):
            render_chat_template(source, messages, True, **extra)
        return
    with tb.budget(tb.FULL):
        got = render_chat_template(source, messages, True, **extra)
        opened = tb._LOCAL.open
        assert opened is not None
        steps, chars = tb.FULL.steps - opened.steps, tb.FULL.chars - opened.chars
    tokenizer.compile_chat_template.cache_clear()
    assert got == want
    assert steps < tb.FULL.steps // 20 and chars < tb.FULL.chars // 100, (steps, chars)


def test_a_template_past_the_inline_budget_is_remembered_and_not_tried_inline_again() -> None:
    source = "{% for i in range(50000) %}{% endfor %}ok"
    tb.HEAVY.discard(source)
    with tb.budget(tb.INLINE), pytest.raises(tb.InlineExhausted):
        render_chat_template(source, [])
    assert source in tb.HEAVY
    t0 = time.perf_counter()
    with tb.budget(tb.INLINE), pytest.raises(tb.InlineExhausted):
        render_chat_template(source, [])
    assert time.perf_counter() - t0 < 0.005  # refused before any step
    with tb.budget(tb.FULL):
        assert render_chat_template(source, []) == "ok"
    tb.HEAVY.discard(source)
