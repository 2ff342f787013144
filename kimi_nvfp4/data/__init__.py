"""Tokenizer loading (never runs checkpoint code), coding-agent session data, chat rendering.

Modules: tokenizer, chat_template (+ template_sandbox), conversations, loaders, agent_sessions (+ source_tree,
sandbox_checks), render, cli. See docs/data.md.
"""
