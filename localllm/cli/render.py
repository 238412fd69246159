"""Rich rendering shared by the CLI commands and the terminal chat: pull progress, sizes and ages, model facts.

Functions here only draw; they take api values (or plain numbers) and never call a client."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable

from rich.progress import (BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from .. import api
from .app import console


# ---------------------------------------------------------------------------------------------------------- pull

def render_pull(stream: Iterable[api.PullProgress]) -> None:
    """Show a pull (or create) stream: byte counts as a progress bar with rate and ETA, other steps as lines."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=console)
    tasks: dict[str, TaskID] = {}
    last_line = None
    try:
        for progress in stream:
            if progress.status.startswith("pulling ") and progress.completed is not None:
                key = progress.digest or progress.status
                if not tasks:
                    bar.start()  # only once there are bytes to show: a pull with nothing to fetch stays two lines
                if key not in tasks:
                    tasks[key] = bar.add_task(progress.status, total=progress.total)
                bar.update(tasks[key], completed=progress.completed, total=progress.total)
            elif progress.status != last_line:
                console.print(progress.status, highlight=False, soft_wrap=True)
                last_line = progress.status
    finally:
        if tasks:
            bar.stop()


# ---------------------------------------------------------------------------------------------------------- units

def human_size(size: int) -> str:
    """Decimal units, as Ollama prints them: 98 MB, 1.2 GB."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit in ("B", "KB", "MB") else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def human_age(moment: datetime) -> str:
    seconds = max(0, int((datetime.now(timezone.utc) - moment).total_seconds()))
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            count = seconds // length
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


# ---------------------------------------------------------------------------------------------------------- show

def print_show(info: api.ShowResponse) -> None:
    """`localllm show MODEL` without flags: the model's facts, then template, system, parameters and license."""
    from ..model_info import context_length

    facts = Table(box=None, show_header=False, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    details = info.details
    for label, value in (("architecture", details.family), ("parameters", details.parameter_size),
                         ("quantization", details.quantization_level), ("context length", context_length(info)),
                         ("format", details.format), ("parent", details.parent_model), ("draft", info.draft),
                         ("path", info.path)):
        if value:
            facts.add_row(f"  {label}", str(value))
    console.print("[bold]Model[/]")
    console.print(facts)
    for title, text in (("Template", info.template), ("System", info.system), ("Parameters", info.parameters),
                        ("License", _first_lines(info.license, 3))):
        if text:
            console.print(f"\n[bold]{title}[/]")
            console.print(_indent(text), markup=False, highlight=False, soft_wrap=True)


def _first_lines(text: str, count: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:count] + (["..."] if len(lines) > count else []))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
