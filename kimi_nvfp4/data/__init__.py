"""Tokenizer loading (never runs checkpoint code), coding-agent session data, chat rendering.

Modules: tokenizer, chat_template, conversations, loaders, agent_sessions (+ source_tree,
sandbox_checks), render, cli. See docs/data.md.
"""
