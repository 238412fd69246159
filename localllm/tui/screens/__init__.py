"""Screens of the TUI: the chat, the models, and the modal dialogs."""
