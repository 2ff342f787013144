import asyncio
import json

import pytest
import torch

from kimi_nvfp4.serve_check.client import ChatClient
from kimi_nvfp4.serve_check.quality.agreement import compare_tokens
from kimi_nvfp4.serve_check.quality.humaneval import build_program, load_problems, run_candidate, run_humaneval
from kimi_nvfp4.serve_check.quality.tool_calls import PROMPTS, TOOLS, run_tool_call_check, validate_call


def _call(name, args):
    return {"id": f"functions.{name}:0", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def test_validate_call_against_schemas():
    assert validate_call(_call("get_weather", {"city": "Hanoi", "unit": "celsius"}), TOOLS) == []
    assert "unknown tool" in validate_call(_call("rm_rf", {}), TOOLS)[0]
    assert "not JSON" in validate_call(_call("read_file", "{path: a}"), TOOLS)[0]
    assert any("'path' is a required property" in p for p in validate_call(_call("read_file", {}), TOOLS))
    assert any("kelvin" in p for p in validate_call(_call("get_weather", {"city": "x", "unit": "kelvin"}), TOOLS))
    assert validate_call(_call("grep", {"pattern": "x", "max_results": 0}), TOOLS)  # minimum 1


def _kimi_call(name, args):
    return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
            f"{json.dumps(args)}<|tool_call_end|><|tool_calls_section_end|>")


def test_tool_call_check_through_the_server(scripted_server):
    script = {PROMPTS[0]: _kimi_call("read_file", {"path": "src/app/main.py"}),
              PROMPTS[1]: _kimi_call("run_tests", {"path": "tests/test_parser.py", "verbose": "yes"})}
    url, _ = scripted_server(script=script)

    async def main():
        async with ChatClient(url) as c:
            return await run_tool_call_check(c, limit=3, max_tokens=200)
    rep = asyncio.run(main())
    assert rep.prompts == 3 and rep.requests_failed == 0
    assert rep.trigger_rate == pytest.approx(2 / 3)
    assert rep.schema_accuracy == pytest.approx(0.5)  # "yes" is not a boolean
    assert rep.cases[0].valid and not rep.cases[1].valid and not rep.cases[2].called


def test_build_program_fenced_whole_function_or_body():
    prompt = "from typing import List\n\ndef add(a: int, b: int) -> int:\n    \"\"\"Add.\"\"\"\n"
    whole = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert build_program(prompt, whole, "add").startswith("from typing import List\ndef add(a, b):")
    body = "    return a + b\n"
    assert build_program(prompt, body, "add") == prompt + body


def test_sandboxed_runner_pass_fail_timeout():
    test = "def check(f):\n    assert f(2, 3) == 5\n"
    assert run_candidate("def add(a, b):\n    return a + b\n", test, "add") == "passed"
    assert run_candidate("def add(a, b):\n    return a - b\n", test, "add").startswith("failed: AssertionError")
    assert run_candidate("def add(a, b):\n    while True: pass\n", test, "add", timeout_s=1.0) == "timed out"
    hog = "def add(a, b):\n    x = bytearray(4 << 30)\n    return a + b\n"
    assert "MemoryError" in run_candidate(hog, test, "add")


def test_real_humaneval_problem_passes_with_its_canonical_solution(scripted_server):
    (p,) = load_problems(limit=1)
    assert p["task_id"] == "HumanEval/0"
    fenced = "```python\n" + p["prompt"] + p["canonical_solution"] + "```"
    url, _ = scripted_server(script={"has_close_elements": fenced})

    async def main():
        async with ChatClient(url) as c:
            return await run_humaneval(c, limit=2, max_tokens=2000,
                                       extra={"chat_template_kwargs": {"thinking": False}})
    rep = asyncio.run(main())
    assert rep.problems == 2 and rep.passed == 1 and rep.pass_at_1 == 0.5
    assert rep.cases[0].passed and not rep.cases[1].passed


def test_compare_tokens_alignment():
    vocab = 5
    prompt_len, out = 3, [2, 4, 1]
    logits = torch.full((prompt_len + len(out) - 1, vocab), -10.0)
    logits[2, 2] = logits[3, 4] = 5.0  # positions predicting out[0], out[1]
    logits[4, 0] = 5.0  # emulator prefers 0 where the server said 1
    server_lp = torch.log_softmax(logits, -1)[[2, 3, 4], out].tolist()
    agree, first, diffs = compare_tokens(prompt_len, out, server_lp, logits)
    assert agree == pytest.approx(2 / 3) and first == 2
    assert max(diffs) < 1e-5
    _, _, diffs = compare_tokens(prompt_len, out, [0.0, 0.0, 0.0], logits)
    assert diffs[2] > 10
