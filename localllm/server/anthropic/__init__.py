"""Anthropic's Messages API: /v1/messages and count_tokens."""
