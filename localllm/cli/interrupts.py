"""Ctrl-C that native code cannot swallow.

Python raises KeyboardInterrupt wherever the main thread is when the SIGINT handler runs. When that is inside a
Python function that native code called back (llama.cpp's log callback, called throughout a model load in the
process), ctypes prints the exception and drops it, and the Ctrl-C is lost: the load goes on and so does the answer.
The handler installed here also notes the interrupt: `raise_noted_interrupt()` raises it again at the next safe point,
and code that handles a KeyboardInterrupt calls `interrupt_handled()`, so that one Ctrl-C stops one thing."""

from __future__ import annotations

import signal
import threading

_noted = threading.Event()


def _on_sigint(signum, frame) -> None:
    _noted.set()
    raise KeyboardInterrupt


def note_interrupts() -> None:
    """Use the noting handler for SIGINT (only the main thread may set handlers; elsewhere nothing changes)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _on_sigint)


def raise_noted_interrupt() -> None:
    """Raise KeyboardInterrupt for a Ctrl-C that was noted but never handled (swallowed on its way)."""
    if _noted.is_set():
        _noted.clear()
        raise KeyboardInterrupt


def interrupt_handled() -> None:
    _noted.clear()
