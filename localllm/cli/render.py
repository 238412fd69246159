"""Rich rendering shared by the CLI commands and the terminal chat: pull progress, sizes and ages, model facts,
answer timings, the `ps` table, and markdown that streams in.

Functions here only draw; they take api values (or plain numbers) and never call a client. Each takes the console to
draw on (`to`), stdout's by default: `run` draws progress on stderr so that stdout carries the answer alone."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime, timezone

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.segment import Segment
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from .. import api
from ..conversation import rate
from .app import console as stdout_console

# ---------------------------------------------------------------------------------------------------------- pull


def render_pull(stream: Iterable[api.PullProgress], *, to: Console | None = None) -> None:
    """Show a pull (or create) stream: byte counts as a progress bar with rate and ETA, other steps as lines."""
    console = to or stdout_console
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    tasks: dict[str, TaskID] = {}
    last_line = None
    try:
        for progress in stream:
            if progress.status.startswith(("pulling ", "quantizing ", "hashing ")) and progress.completed is not None:
                key = progress.digest or progress.status
                if not tasks:
                    bar.start()  # only once there are bytes to show: a pull with nothing to fetch stays two lines
                if key not in tasks:
                    tasks[key] = bar.add_task(progress.status, total=progress.total)
                bar.update(tasks[key], completed=progress.completed, total=progress.total)
            elif progress.status != last_line:
                if bar.live.is_started and bar.finished:
                    bar.stop()  # the bytes are in: the bar stays above "verifying", "writing manifest", "success"
                console.print(progress.status, highlight=False, soft_wrap=True)
                last_line = progress.status
    finally:
        if bar.live.is_started:
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


def human_until(moment: datetime | None, *, busy: bool) -> str:
    """How long until a loaded model is unloaded: "4 minutes"; no expiry means in use, or kept forever."""
    if moment is None:
        return "in use" if busy else "forever"
    seconds = int((moment - datetime.now(timezone.utc)).total_seconds())
    if seconds < 60:
        return "less than a minute" if seconds > 0 else "now"
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            count = seconds // length
            return f"{count} {unit}{'s' if count > 1 else ''}"
    return "now"


def human_duration(nanoseconds: int) -> str:
    """Go's time.Duration style, as Ollama's --verbose prints it: "1.169s", "266.036ms", "950µs"."""
    seconds = nanoseconds / 1e9
    if seconds >= 1:
        return f"{seconds:.3f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f}ms"
    return f"{seconds * 1e6:.0f}µs"


# ---------------------------------------------------------------------------------------------------------- show


def print_show(info: api.ShowResponse, *, to: Console | None = None) -> None:
    """`localllm show MODEL` without flags: the model's facts, then capabilities, template, system, parameters and
    license."""
    console = to or stdout_console
    print_model_facts(info, to=console)
    adapters = "\n".join(f"{a.path} (scale {a.scale:g})" for a in info.adapters)
    for title, text in (
        ("Capabilities", "\n".join(info.capabilities)),
        ("Adapters", adapters),
        ("Quantization", _report_text(info.quantization_report)),
        ("Template", info.template),
        ("System", info.system),
        ("Parameters", info.parameters),
        ("License", _first_lines(info.license, 3)),
    ):
        if text:
            console.print(f"\n[bold]{title}[/]")
            console.print(_indent(text), markup=False, highlight=False, soft_wrap=True)


def print_model_facts(info: api.ShowResponse, *, to: Console | None = None) -> None:
    """The "Model" block of `show`: architecture, size, quantization, context, format, parent, draft, path."""
    from ..models.info import context_length

    facts = Table(box=None, show_header=False, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    details = info.details
    for label, value in (
        ("architecture", details.family),
        ("parameters", details.parameter_size),
        ("quantization", details.quantization_level),
        ("context length", context_length(info)),
        ("format", details.format),
        ("parent", details.parent_model),
        ("draft", info.draft),
        ("path", info.path),
        ("split parts", len(info.parts) or None),
    ):
        if value:
            facts.add_row(f"  {label}", str(value))
    console = to or stdout_console
    console.print("[bold]Model[/]")
    console.print(facts)


def _report_text(report: api.QuantizationReport | None) -> str:
    if report is None:
        return ""
    from ..quant.quality import describe_report

    return "\n".join(line.strip() for line in describe_report(report))


def _first_lines(text: str, count: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:count] + (["..."] if len(lines) > count else []))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# ---------------------------------------------------------------------------------------------------------- timings


def timing_rows(t: api.Timings) -> list[tuple[str, str]]:
    """Ollama's --verbose figures for one answer, plus ours: prompt tokens reused from the cache, speculation.

    The prompt eval count and rate are over the tokens actually evaluated; the reused ones are counted apart (their
    time is not in prompt_eval_duration, so counting them would inflate the rate)."""
    evaluated = max(0, t.prompt_eval_count - t.prompt_cache_count)
    rows = [
        ("total duration", human_duration(t.total_duration)),
        ("load duration", human_duration(t.load_duration)),
        ("prompt eval count", f"{evaluated} token(s)"),
        ("prompt cache", f"{t.prompt_cache_count} token(s) reused"),
        ("prompt eval duration", human_duration(t.prompt_eval_duration)),
        ("prompt eval rate", _rate_text(evaluated, t.prompt_eval_duration)),
        ("eval count", f"{t.eval_count} token(s)"),
        ("eval duration", human_duration(t.eval_duration)),
        ("eval rate", _rate_text(t.eval_count, t.eval_duration)),
    ]
    if t.draft_count:
        rows.append(
            (
                "speculation",
                f"{t.draft_accepted}/{t.draft_count} drafted tokens accepted ({t.draft_accepted / t.draft_count:.0%})",
            )
        )
    if t.truncated_tokens:
        rows.append(("truncated", f"{t.truncated_tokens} prompt token(s) dropped"))
    return rows


def print_timings(t: api.Timings, *, to: Console | None = None) -> None:
    console = to or stdout_console
    for label, value in timing_rows(t):
        console.print(f"{label + ':':<22}{value}", highlight=False, markup=False)


def _rate_text(count: int, duration_ns: int) -> str:
    value = rate(count, duration_ns)
    return f"{value:.2f} tokens/s" if value is not None else "-"


# ---------------------------------------------------------------------------------------------------------- ps

PS_COLUMNS = ("NAME", "ID", "SIZE", "BACKEND", "BUSY", "CTX/SLOT", "KV", "LAYERS", "SPEC", "PREFIX CACHE", "UNTIL")
# Below this width the ID goes (`localllm ps | cat` prints it) and the long headers shorten, so a row fits 80 columns.
PS_WIDE = 100
_NARROW_HEADERS = {"CTX/SLOT": "CTX", "PREFIX CACHE": "CACHE"}
# On a narrow terminal these fold, so the name stays whole.
_WRAPPABLE = frozenset({"BACKEND", "LAYERS", "SPEC", "PREFIX CACHE", "UNTIL"})


def ps_rows(models: Iterable[api.ProcessModel]) -> list[tuple[str, ...]]:
    """`localllm ps`: effective values, never totals to divide (context is per slot; BUSY is busy/total slots)."""
    return [
        (
            row.name,
            row.digest[:12],
            _size_text(row),
            _backend_text(row),
            _slots_text(row),
            str(row.context_length),
            _kv_text(row),
            _placement_text(row),
            _speculation_text(row),
            _prefix_cache_text(row),
            _until_text(row),
        )
        for row in models
    ]


def _until_text(row: api.ProcessModel) -> str:
    if row.status == "removed":
        return "removed, unloading"
    return human_until(row.expires_at, busy=row.slots_busy > 0)


def ps_table(models: Iterable[api.ProcessModel], *, width: int = PS_WIDE) -> Table:
    """The `ps` table for a terminal `width` columns wide."""
    narrow = width < PS_WIDE
    shown = [i for i, column in enumerate(PS_COLUMNS) if not (narrow and column == "ID")]
    table = Table(box=None, pad_edge=False)
    for i in shown:
        column = PS_COLUMNS[i]
        table.add_column(_NARROW_HEADERS.get(column, column) if narrow else column, no_wrap=column not in _WRAPPABLE)
    for row in ps_rows(models):
        table.add_row(*(row[i] for i in shown))
    return table


def ps_text(models: Iterable[api.ProcessModel]) -> str:
    """The `ps` table as plain aligned text with every column and whole values (for a pipe or a file)."""
    rows = [PS_COLUMNS, *ps_rows(models)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(PS_COLUMNS))]
    return "\n".join("   ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip() for row in rows)


def _backend_text(row: api.ProcessModel) -> str:
    """ "llama.cpp, 2 threads (auto)": the CPU threads its decode steps use now, tuned as it runs or pinned."""
    if not row.threads:
        return row.backend
    return f"{row.backend}, {row.threads} thread{'s' if row.threads > 1 else ''}{' (auto)' if row.threads_auto else ''}"


def _kv_text(row: api.ProcessModel) -> str:
    """ "f16 812/4096, flash off": the cache type, the pool's tokens held of those the slots share, and flash
    attention where it is not left to the backend."""
    text = f"{row.kv_type} {row.kv_used}/{row.kv_cells}" if row.kv_cells else row.kv_type
    if row.flash_attn is None:
        return text
    return f"{text}, flash {'on' if row.flash_attn else 'off'}"


def _size_text(row: api.ProcessModel) -> str:
    # Weights shared in memory are counted once: say so where the size is read.
    shared = f" (weights shared with {', '.join(row.shares_weights_with)})" if row.shares_weights_with else ""
    return human_size(row.size) + shared


def _slots_text(row: api.ProcessModel) -> str:
    text = f"{row.slots_busy}/{row.slots_total}"
    return text + (f" +{row.queue_depth} queued" if row.queue_depth else "")


def _placement_text(row: api.ProcessModel) -> str:
    """Where the layers run, "CPU 10, RPC0 127.0.0.1:50052 21"; the num_gpu setting where the backend placed none."""
    if not row.placement:
        return _gpu_text(row.gpu_layers)
    return ", ".join(
        f"{p.device}{' ' + p.description if p.device.startswith('RPC') else ''} {p.layers}" for p in row.placement
    )


def _gpu_text(layers: int) -> str:
    # -1 asks the backend for every layer that fits; what it managed is the backend's to report.
    return {-1: "auto", 0: "CPU"}.get(layers, f"{layers} layers")


def _prefix_cache_text(row: api.ProcessModel) -> str:
    """RAM held/limit, and disk when it is on: prefixes saved beyond the slots."""
    text = f"{human_size(row.cache_ram_bytes)}/{human_size(row.cache_ram_limit)} RAM" if row.cache_ram_limit else "off"
    if row.cache_disk_limit:
        text += f", {human_size(row.cache_disk_bytes)}/{human_size(row.cache_disk_limit)} disk"
    return text


def _speculation_text(row: api.ProcessModel) -> str:
    text = row.speculation
    if row.draft is not None:  # what the draft model costs beside the model: its weights, KV and threads
        d = row.draft
        text += f" {d.model} ({human_size(d.size)}, KV {d.kv_cells:,} tokens, {d.threads} threads)"
    if row.draft_count:
        text += f" ({row.draft_accepted / row.draft_count:.0%} accepted)"
    return text


# ---------------------------------------------------------------------------------------------------------- markdown

_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def split_finished(text: str) -> tuple[str, str]:
    """Split streamed markdown into (finished blocks, the block still being written).

    A block is finished at a blank line outside a code fence, or at a fence that closes; only whole lines count."""
    in_fence, cut, pos = False, 0, 0
    for line in text.split("\n")[:-1]:
        pos += len(line) + 1
        if _FENCE.match(line):
            in_fence = not in_fence
            cut = pos if not in_fence else cut
        elif not in_fence and not line.strip():
            cut = pos
    return text[:cut], text[cut:]


class _Lines:
    """Already rendered lines, drawn as they are."""

    def __init__(self, lines: list[list[Segment]]):
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines:
            yield from line
            yield Segment.line()


class _Tail:
    """Draws only the last lines of a renderable that fit the terminal, so a long block being written stays in view
    (rich's Live cannot scroll: it would leave copies of what passed the top)."""

    def __init__(self, renderable: RenderableType):
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        yield _Lines(lines[-max(1, console.height - 2) :])


class MarkdownStream:
    """Markdown drawn while it streams in: finished blocks are printed once and stay; the block still being written
    is redrawn in place. A spinner shows until the first text arrives. Use as a context manager.

    A reasoning model's thinking (`think`) is drawn dimmed while it comes, and printed above the answer once the
    answer begins.

    The finished part is rendered as one document and only its new lines are printed, so spacing between blocks
    (lists, code, paragraphs) is what the whole answer would get."""

    def __init__(self, console: Console, *, waiting: str = ""):
        self._console = console
        self._finished = ""
        self._pending = ""
        self._thinking = ""
        self._printed_lines = 0
        self._live = Live(
            Spinner("dots", text=waiting, style="dim"), console=console, transient=True, refresh_per_second=8
        )

    def __enter__(self) -> MarkdownStream:
        self._live.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def think(self, text: str) -> None:
        self._thinking += text
        self._live.update(_Tail(Text(self._thinking.lstrip(), style="dim")))

    def write(self, text: str) -> None:
        if not text:
            return
        self._print_thinking()
        finished, self._pending = split_finished(self._pending + text)
        if finished:
            self._print_finished(finished)
        self._live.update(_Tail(Markdown(self._pending)))

    def close(self) -> None:
        self._live.stop()
        self._print_thinking()
        self._print_finished(self._pending)
        self._pending = ""

    def _print_thinking(self) -> None:
        if self._thinking.strip():
            self._console.print(Text(self._thinking.strip(), style="dim"))
            self._console.print()
        self._thinking = ""

    def _print_finished(self, text: str) -> None:
        self._finished += text
        if not self._finished.strip():
            return
        lines = self._console.render_lines(Markdown(self._finished), self._console.options, pad=False)
        self._console.print(_Lines(lines[self._printed_lines :]), end="")
        self._printed_lines = len(lines)


class RawStream:
    """An answer printed as it comes, unrendered and unwrapped (`/set nowordwrap`): the terminal wraps the lines.
    The same context manager, `think` and `write` as MarkdownStream."""

    def __init__(self, console: Console):
        self._console = console
        self._ended_line = True

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc_info) -> None:
        if not self._ended_line:
            self._console.file.write("\n")
        self._console.file.flush()

    def think(self, text: str) -> None:
        """Thinking, dimmed, as it comes (above the answer, which follows it)."""
        if text:
            self._console.print(Text(text, style="dim"), end="")
            self._ended_line = text.endswith("\n")

    def write(self, text: str) -> None:
        if text:
            self._console.file.write(text)
            self._console.file.flush()
            self._ended_line = text.endswith("\n")
