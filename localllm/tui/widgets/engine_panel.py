"""The side panel of live engine figures: server state, busy slots and queue, context, speed, cache reuse and
speculative acceptance. The chat screen sets its attributes; the panel only draws them."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table
from textual.reactive import reactive
from textual.widgets import Static

from ... import api


@dataclass(frozen=True)
class EngineFigures:
    """Everything the panel shows, as one value (so setting it is one refresh)."""

    server: str = "connecting…"
    model: str = ""
    process: api.ProcessModel | None = None
    live_rate: float | None = None  # tokens/s of the answer being written
    last_rate: float | None = None  # tokens/s of the last finished answer
    prompt_tokens: int = 0
    cached_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


class EnginePanel(Static):
    figures: reactive[EngineFigures] = reactive(EngineFigures, layout=True)

    def render(self) -> Table:
        f = self.figures
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for label, value in _rows(f):
            table.add_row(label, value)
        return table


def thread_text(p: api.ProcessModel) -> str:
    """ "2 (auto)" while the engine tunes the count, "4" when pinned, "-" where the backend (MLX) chooses."""
    if not p.threads:
        return "-"
    return f"{p.threads} (auto)" if p.threads_auto else str(p.threads)


def _rows(f: EngineFigures) -> list[tuple[str, str]]:
    rows = [("Server", f.server), ("Model", f.model or "none (F2)")]
    p = f.process
    if p is None:
        rows.append(("Engine", "not loaded"))
    else:
        rows += [
            ("Backend", p.backend),
            ("Slots", f"{p.slots_busy}/{p.slots_total} busy"),
            ("Queue", str(p.queue_depth)),
            ("Context", f"{p.context_length}/slot"),
            ("KV", p.kv_type),
            ("Threads", thread_text(p)),
        ]
    rate = f.live_rate if f.live_rate is not None else f.last_rate
    rows.append(("Speed", f"{rate:.1f} tok/s" if rate is not None else "-"))
    share = f" ({f.cached_tokens / f.prompt_tokens:.0%})" if f.prompt_tokens else ""
    rows.append(("Cache", f"{f.cached_tokens}/{f.prompt_tokens} reused{share}"))
    rows.append(("Spec.", f"{f.accepted}/{f.drafted} accepted" if f.drafted else (p.speculation if p else "none")))
    return rows
