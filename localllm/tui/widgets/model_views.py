"""What the models screen draws: the facts of the highlighted model, and the progress of a pull."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Label, ProgressBar, Static

from ... import api


class ModelDetails(Static):
    """The facts `localllm show` prints, for the model the table's cursor is on."""

    info: reactive[api.ShowResponse | None] = reactive(None, layout=True)

    def render(self) -> Table | str:
        if self.info is None:
            return "Select a model to see its details."
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for label, value in _facts(self.info):
            table.add_row(label, value)
        return table


def _facts(info: api.ShowResponse) -> list[tuple[str, str]]:
    from ...models.info import context_length

    d = info.details
    rows = [
        ("Architecture", d.family),
        ("Parameters", d.parameter_size),
        ("Quantization", d.quantization_level),
        ("Context", str(context_length(info) or "")),
        ("Format", d.format),
        ("Capabilities", ", ".join(info.capabilities)),
        ("Parent", d.parent_model),
        ("Draft", info.draft or ""),
        ("System", info.system),
        ("Parameters set", _one_per_line(info.parameters)),
    ]
    return [(label, value) for label, value in rows if value]


def _one_per_line(parameters: str) -> str:
    # show's text pads names to a column; in the narrow pane each parameter keeps a line of its own, single-spaced,
    # so a long value wraps under itself instead of running into the next parameter.
    return "\n".join(" ".join(line.split()) for line in parameters.splitlines())


class PullView(Vertical):
    """A pull's progress: the current step as text, and the bytes as a bar."""

    progress: reactive[api.PullProgress | None] = reactive(None)

    def compose(self) -> ComposeResult:
        yield Label("", id="pull-status")
        yield ProgressBar(id="pull-bar", show_eta=True)

    def watch_progress(self, progress: api.PullProgress | None) -> None:
        self.display = progress is not None
        if progress is None:
            return
        self.query_one("#pull-status", Label).update(progress.status)
        if progress.completed is not None:
            self.query_one("#pull-bar", ProgressBar).update(total=progress.total, progress=progress.completed)

    @property
    def completed(self) -> float:
        return self.query_one("#pull-bar", ProgressBar).progress

    @property
    def status(self) -> str:
        return self.progress.status if self.progress else ""
