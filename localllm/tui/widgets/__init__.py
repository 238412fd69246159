"""Widgets of the TUI. Each displays what its parent sets on it and reports what the user did as a message."""
