"""The bundled demo model (trained on Kimi-format agent chats) through the reference server: the full
chain emulator -> detokenizer -> kimi_k2 parser -> OpenAI tool_calls -> schema validation."""

import asyncio

import pytest

from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.serve_check.client import ChatClient
from kimi_nvfp4.serve_check.engine import EmulatorEngine
from kimi_nvfp4.serve_check.quality.tool_calls import run_tool_call_check
from kimi_nvfp4.serve_check.reference_server import ReferenceServer


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    from kimi_nvfp4.convert.api import convert_checkpoint

    if not (DEMO_CHECKPOINT / "config.json").is_file():
        pytest.fail(f"the bundled demo checkpoint is missing at {DEMO_CHECKPOINT}")
    out = tmp_path_factory.mktemp("demo") / "nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, out, progress=False)
    # not calibrated here: emulate the weight-only (Hopper) path
    with ReferenceServer(EmulatorEngine(out, activations="w4a16")) as server:
        yield server


def test_demo_model_makes_schema_valid_kimi_tool_calls(demo_server):
    async def main():
        async with ChatClient(demo_server.base_url) as c:
            return await run_tool_call_check(c, suite="agent", max_tokens=64, limit=4)
    rep = asyncio.run(main())
    assert rep.requests_failed == 0
    assert rep.trigger_rate >= 0.5, rep.cases
    valid = [call for case in rep.cases if case.valid for call in case.calls]
    assert valid and all(call["id"].startswith(f"functions.{call['function']['name']}:") for call in valid)
