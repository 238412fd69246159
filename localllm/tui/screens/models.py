"""The models screen: the stored models in a table, the details of the highlighted one, pull with progress, delete.
Enter picks the highlighted model and returns it to the chat (the screen's dismiss value)."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input

from ... import api
from ...client.protocol import Client
from ...errors import LocalLLMError
from ..messages import ErrorReported
from ..widgets.model_views import ModelDetails, PullView
from .dialogs import ConfirmScreen

COLUMNS = ("Name", "Size", "Format", "Quantization", "Modified")


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


class ModelsScreen(Screen[str | None]):
    BINDINGS = [
        Binding("escape", "close", "Back to chat"),
        Binding("d,delete", "delete", "Delete"),
        Binding("p", "focus_pull", "Pull"),
        Binding("r", "refresh", "Refresh"),
    ]

    def __init__(self, client: Client, *, current: str = ""):
        super().__init__()
        self.client = client
        self.current = current

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="models-body"):
            yield DataTable(id="model-table", cursor_type="row", zebra_stripes=True)
            yield ModelDetails(id="details")
        with Vertical(id="pull-area"):
            with Horizontal(id="pull-row"):
                yield Input(
                    placeholder="model to pull: smollm2:135m, hf.co/<org>/<repo>, a URL or a .gguf path", id="pull-name"
                )
                yield Button("Pull", id="pull", variant="primary")
            yield PullView(id="pull-progress")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Models: Enter chats with the highlighted model"
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.query_one(PullView).display = False
        self.query_one(DataTable).focus()
        self.load_models()

    # ----------------------------------------------------------------------------------------------- list, details

    @work(thread=True, exclusive=True, group="list")
    def load_models(self) -> None:
        try:
            listing = self.client.list_models()
        except LocalLLMError as exc:
            self.post_message(ErrorReported(exc, title="Cannot list models"))
            return
        self.app.call_from_thread(self._fill_table, listing)

    def _fill_table(self, listing: api.ListResponse) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for row in sorted(listing.models, key=lambda m: m.name):
            table.add_row(
                row.name,
                _size(row.size),
                row.details.format,
                row.details.quantization_level,
                row.modified_at.strftime("%Y-%m-%d"),
                key=row.name,
            )
        names = [m.name for m in sorted(listing.models, key=lambda m: m.name)]
        if self.current in names:
            table.move_cursor(row=names.index(self.current))

    @on(DataTable.RowHighlighted)
    def highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None:
            self.load_details(event.row_key.value)

    @work(thread=True, exclusive=True, group="details")
    def load_details(self, name: str) -> None:
        try:
            info = self.client.show(name)
        except LocalLLMError as exc:
            self.post_message(ErrorReported(exc, title=f"Cannot show {name}"))
            return
        self.app.call_from_thread(setattr, self.query_one(ModelDetails), "info", info)

    @on(DataTable.RowSelected)
    def picked(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    def selected_name(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    # ----------------------------------------------------------------------------------------------- pull

    @on(Input.Submitted, "#pull-name")
    @on(Button.Pressed, "#pull")
    def start_pull(self) -> None:
        name = self.query_one("#pull-name", Input).value.strip()
        if not name:
            self.notify("Type the name of a model to pull.", severity="warning")
            return
        self.pull(name)

    @work(thread=True, exclusive=True, group="pull")
    def pull(self, name: str) -> None:
        view = self.query_one(PullView)
        try:
            for progress in self.client.pull(name):
                self.app.call_from_thread(setattr, view, "progress", progress)
        except LocalLLMError as exc:
            self.post_message(ErrorReported(exc, title=f"Pull of {name} failed"))
            return
        self.app.call_from_thread(self.notify, f"Pulled {name}.", markup=False)
        self.app.call_from_thread(self.load_models)

    # ----------------------------------------------------------------------------------------------- actions

    def action_close(self) -> None:
        self.dismiss(None)

    def action_focus_pull(self) -> None:
        self.query_one("#pull-name", Input).focus()

    def action_refresh(self) -> None:
        self.load_models()

    def action_delete(self) -> None:
        name = self.selected_name()
        if name is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete(name)

        self.app.push_screen(ConfirmScreen(f"Delete {name}?"), callback=confirmed)

    @work(thread=True, group="delete")
    def delete(self, name: str) -> None:
        try:
            self.client.delete(name)
        except LocalLLMError as exc:
            self.post_message(ErrorReported(exc, title=f"Cannot delete {name}"))
            return
        self.app.call_from_thread(self.notify, f"Deleted {name}.", markup=False)
        self.app.call_from_thread(self.load_models)
