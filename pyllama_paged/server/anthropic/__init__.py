"""Anthropic's Messages dialect."""
