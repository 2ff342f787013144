"""Quality smoke tests run against a serving endpoint: HumanEval, Kimi tool calls, emulator agreement."""
