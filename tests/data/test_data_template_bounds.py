"""Chat templates are untrusted: bombs end in a ChatTemplateError within the budget, never a hang."""

import threading
import time

import pytest

from kimi_nvfp4.data.chat_template import ChatTemplate
from kimi_nvfp4.data.errors import ChatTemplateError
from kimi_nvfp4.data.template_sandbox import MAX_RENDERED_CHARS, TemplateBudgetExceeded, within_budget

BUDGET_S = 1.0
# Generous: the budget plus what a loaded 2-core CI machine may take to schedule the threads.
WALL_LIMIT_S = BUDGET_S + 20.0
MESSAGES = [{"role": "user", "content": "hi"}]

BOMBS = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "power folded at compile time": "{{ 9 ** (9 ** 9) }}",
    "string repetition": "{{ 'a' * 1000000000 }}",
    "list repetition": "{{ ([1] * 100000000)|length }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}",
    "doubling with a filter": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                              "{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
    "filter width": "{{ 'a'|center(1000000000) }}",
    "method width": "{{ 'a'.ljust(1000000000) }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "printf width": "{{ '%999999999d' % 1 }}",
    "format filter width": "{{ '%999999999d'|format(1) }}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "loops over a long string": "{% set x = 'a' * 1000000 %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}",
    "unbounded macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "lipsum": "{{ lipsum(n=100000000) }}",
}


@pytest.mark.parametrize("source", BOMBS.values(), ids=BOMBS.keys())
def test_bombs_are_refused_within_the_budget(source):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="bomb.jinja.*(limit|longer than|recursed)"):
        ChatTemplate(source, "bomb.jinja", time_budget_s=BUDGET_S).render(MESSAGES)
    assert time.monotonic() - start < WALL_LIMIT_S


@pytest.mark.parametrize("tag, source", [
    ("include", "{% include 'other.jinja' %}"),
    ("import", "{% import 'macros.jinja' as m %}{{ m.x() }}"),
    ("from ... import", "{% from 'macros.jinja' import x %}"),
    ("extends", "{% extends 'base.jinja' %}"),
])
def test_templates_that_load_other_templates_are_named_errors(tag, source):
    with pytest.raises(ChatTemplateError, match=rf"tpl\.jinja: chat template uses \{{% {tag} %\}} \(line 1\)"):
        ChatTemplate(source, "tpl.jinja")


@pytest.mark.parametrize("source, error", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("{{ messages[0].content.nope() }}", "failed to render"),
])
def test_template_bugs_are_named_errors(source, error):
    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate(source, "tpl.jinja").render(MESSAGES)


def test_ordinary_arithmetic_and_repetition_still_work():
    t = ChatTemplate("{{ 2 ** 10 }} {{ '-' * 3 }} {{ [0] * 2 }} {{ 'a' ~ 'b' }} {{ '%5d' % 7 }} "
                     "{{ '{:>4}'.format('x') }} {{ 'ab'|center(6) }}|{{ messages[0].content * 2 }}", "tpl.jinja")
    assert t.render(MESSAGES) == "1024 --- [0, 0] ab     7    x   ab  |hihi"


def test_output_up_to_the_limit_renders():
    n = MAX_RENDERED_CHARS // 1000
    out = ChatTemplate("{% for i in range(" + str(n) + ") %}{{ 'x' * 1000 }}{% endfor %}", "tpl.jinja").render([])
    assert len(out) == n * 1000


def test_the_deadline_never_lands_after_a_render_finished():
    """Renders that end right at their deadline, in several threads: no interrupt may leak into later
    code, and the watchdog must still stop a bomb afterwards (an interrupt landing inside the
    watchdog's own lock handling once left its lock held and every later bomb running forever)."""
    def quick_renders():
        for size in range(300):
            try:
                within_budget(lambda: sum(range(size * 50)), 0.0001)
            except TemplateBudgetExceeded:
                pass
    threads = [threading.Thread(target=quick_renders) for _ in range(3)]
    for t in threads:
        t.start()
    quick_renders()
    for t in threads:
        t.join()
    time.sleep(0.05)  # an interrupt still pending would fire during this
    assert sum(range(10)) == 45
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran longer than"):
        ChatTemplate(BOMBS["nested range loops"], "bomb.jinja", time_budget_s=BUDGET_S).render(MESSAGES)
    assert time.monotonic() - start < WALL_LIMIT_S


def test_budgets_are_per_thread():
    """A bomb in one thread does not stop a quick render running in another."""
    results = {}

    def bomb():
        try:
            ChatTemplate(BOMBS["nested range loops"], "bomb.jinja", time_budget_s=BUDGET_S).render(MESSAGES)
        except ChatTemplateError as e:
            results["bomb"] = str(e)

    worker = threading.Thread(target=bomb)
    worker.start()
    quick = ChatTemplate("{{ messages[0].content }}", "ok.jinja")
    for _ in range(50):
        assert quick.render(MESSAGES) == "hi"
    worker.join(WALL_LIMIT_S)
    assert "ran longer than" in results["bomb"]


@pytest.mark.parametrize("name", ["power folded at compile time", "nested range loops"])
def test_a_checkpoint_with_a_bomb_template_fails_fast_in_the_tokenizer(kimi_tiktoken_dir, tmp_path, name):
    """What calibrate, validate and the reference server call: a named error, not a hang."""
    import shutil

    from kimi_nvfp4.data import template_sandbox
    from kimi_nvfp4.data.tokenizer import load_tokenizer

    folder = tmp_path / "ckpt"
    shutil.copytree(kimi_tiktoken_dir, folder)
    (folder / "chat_template.jinja").write_text(BOMBS[name])
    tok = load_tokenizer(folder)
    tok.chat_template = ChatTemplate(tok.chat_template.source, tok.chat_template.origin, time_budget_s=BUDGET_S)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: chat template went past a limit"):
        tok.encode_chat(MESSAGES)
    assert time.monotonic() - start < WALL_LIMIT_S
    assert template_sandbox.RENDER_TIME_BUDGET_S == 10.0  # what a checkpoint's template gets by default
