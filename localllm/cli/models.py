"""Commands registered on the shared app (see cli/app.py)."""

from .app import app  # noqa: F401
