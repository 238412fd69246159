"""Chat templates (Jinja and Ollama's Go templates) in a bounded sandbox, thinking, and structured output."""
