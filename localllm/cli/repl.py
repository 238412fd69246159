"""The interactive chat of `localllm run MODEL`: a prompt with history and multi-line input, answers streamed as
markdown, and Ollama's slash commands (/set, /show, /load, /save, /clear, /help, /bye) plus /stats and /image. With
a vision model, image files named in a message go with it, as in Ollama's chat (image_files.py).

Ctrl-C while an answer streams closes the response stream (which cancels the request, on the server too) and returns
to the prompt; Ctrl-C at the prompt prints a hint; Ctrl-D or /bye ends the chat. A bad command or value is a one-line
error and the chat goes on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from .. import api
from ..client.protocol import Client, RequestStream
from ..conversation import Conversation, is_model
from ..errors import InvalidInput, LocalLLMError, ModelNotFound
from .app import console, err_console, print_error
from .image_files import cut_mentions, find_image_files, read_image_file
from .interrupts import interrupt_handled, raise_noted_interrupt
from .line_input import TRIPLE_QUOTE, LineInput, keys_not_echoed, read_message, unquote
from .mcp_chat import HELP_TOOLS, ChatTools
from .prompt_cache_file import is_prompt_cache_file, read_prompt_cache, write_prompt_cache
from .render import MarkdownStream, RawStream, print_model_facts, print_timings, render_pull, timing_rows

EXIT_HINT = "Use Ctrl + d or /bye to exit."

HELP = f"""Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /save <file.kv> Save this chat with its prompt cache to a file
  /load <file.kv> Go on with a chat saved with its prompt cache
  /clear          Clear session context
  /image <path>   Attach an image to the next message (a model with vision)
  /stats          Show speed, prompt cache reuse and speculation figures
  /tools          List the MCP tools; /tools on|off SERVER for this chat
  /prompt         Send an MCP server's prompt (/prompt lists them)
  /resource       Attach an MCP server's resource (/resource lists them)
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use {TRIPLE_QUOTE} to begin a multi-line message.
Name a .jpg, .jpeg, .png or .webp file in a message to attach it (a model with vision)."""

HELP_SET = """Available Commands:
  /set parameter NAME VALUE   Set a parameter (/set parameter alone lists them)
  /set system <string>        Set system message
  /set format json            Enable JSON mode
  /set noformat               Disable formatting
  /set think [level]          Enable thinking (level: low, medium or high)
  /set nothink                Disable thinking
  /set verbose                Show timings after each answer
  /set quiet                  Disable timings
  /set history                Save the messages you type to the history file
  /set nohistory              Stop saving them (this chat still recalls them)
  /set wordwrap               Draw answers as markdown, wrapped at words
  /set nowordwrap             Print answers as raw text, as they come"""

HELP_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template"""

HELP_SHORTCUTS = f"""Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line
  Ctrl + e            Move to the end of the line
  Up / Down           Previous / next message in the history
  Ctrl + r            Search the history
  Ctrl + c            Stop the answer being written
  Ctrl + d            Exit (on an empty line)
  {TRIPLE_QUOTE}                 Begin or end a multi-line message"""

HELP_PARAMETERS = """Parameters (any Modelfile parameter is accepted):
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size (per slot; reloads the model)
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter num_gpu <int>          The number of layers to send to the GPU
  /set parameter stop <string> ...      Set the stop parameters"""


# ---------------------------------------------------------------------------------------------------------- input


# ---------------------------------------------------------------------------------------------------------- answers


def stream_reply(
    stream: RequestStream[api.ChatChunk],
    on_text: Callable[[str], None],
    on_thinking: Callable[[str], None] | None = None,
) -> api.ChatChunk | None:
    """Feed each piece of an answer to `on_text` (and of its thinking to `on_thinking`) and return its last chunk
    (which carries the timings).

    The stream is closed on every way out, so Ctrl-C (KeyboardInterrupt) cancels the request, server-side too."""
    try:
        for chunk in stream:
            raise_noted_interrupt()
            if chunk.message.thinking and on_thinking is not None:
                on_thinking(chunk.message.thinking)
            on_text(chunk.message.content)
            if chunk.done:
                return chunk
        return None
    finally:
        stream.close()


def prepare_model(client: Client, load: api.ChatRequest, *, to: Console) -> None:
    """Pull the model when the store lacks it (progress bar), then load it (a spinner that says so).

    `load` is a request without messages: it loads the model with its load options and answers done."""
    try:
        client.show(load.model)
    except ModelNotFound:
        render_pull(client.pull(load.model), to=to)
    with to.status(f"loading {load.model}…", spinner="dots"):
        for _ in client.chat(load):
            pass
    raise_noted_interrupt()  # a Ctrl-C during an in-process load is swallowed by the engine's native callbacks


# ---------------------------------------------------------------------------------------------------------- repl


class Repl:
    """The chat loop. Each slash command is one small method, found through `_commands`."""

    def __init__(
        self,
        client: Client,
        conversation: Conversation,
        *,
        reader: LineInput,
        verbose: bool = False,
        hide_thinking: bool = False,
        tools: ChatTools | None = None,
    ):
        self.client = client
        self.tools = tools  # MCP tools (cli/mcp_chat.py), when mcp.json names servers
        self.conversation = conversation
        self.reader = reader
        self.verbose = verbose
        self.wordwrap = True
        self.hide_thinking = hide_thinking
        self.images: list[str] = []  # base64 images /image attached to the next message
        self._vision: dict[str, bool] = {}  # by model name: whether its capabilities list vision
        self._commands: dict[str, Callable[[str], bool | None]] = {
            "/set": self._set,
            "/show": self._show,
            "/load": self._load,
            "/save": self._save,
            "/clear": self._clear,
            "/image": self._image,
            "/stats": self._stats,
            "/tools": self._tools,
            "/prompt": self._prompt,
            "/resource": self._resource,
            "/help": self._help,
            "/?": self._help,
            "/bye": self._bye,
            "/exit": self._bye,
        }

    def run(self) -> None:
        """Chat until Ctrl-D or /bye."""
        while True:
            try:
                text = read_message(self.reader)
            except KeyboardInterrupt:
                interrupt_handled()
                console.print(EXIT_HINT, highlight=False)
                continue
            except EOFError:
                console.print()
                return
            if not self._handle(text):
                return

    def _handle(self, text: str) -> bool:
        """Answer or run one input; False ends the chat. Errors are one line and the chat goes on."""
        try:
            if text.lstrip().startswith("/") and not self._opens_with_image(text.lstrip()):
                return self._command(text.strip())
            if text.strip():
                self.ask(unquote(self._take_images(text)))  # first: a quoted path keeps its quotes
        except LocalLLMError as exc:
            print_error(exc)
        except KeyboardInterrupt:  # e.g. during /load: stop that, not the chat
            interrupt_handled()
            console.print("[dim](stopped)[/]", highlight=False)
        return True

    def ask(self, text: str) -> None:
        """Stream the answer to `text` as markdown; Ctrl-C stops it and keeps what was written."""
        request = self.conversation.ask(text, self.images)
        self.images = []  # sent: they stay in the history, with the message they came with
        if self.tools is not None:
            if self.reader.take_interrupt():
                self.conversation.withdraw()
                raise KeyboardInterrupt
            self.tools.answer(
                self.conversation,
                self.reader,
                keys_not_echoed,
                wordwrap=self.wordwrap,
                hide_thinking=self.hide_thinking,
                verbose=self.verbose,
            )
            return
        parts: list[str] = []
        thoughts: list[str] = []
        final = None

        def show(piece: str) -> None:
            parts.append(piece)
            view.write(piece)

        def think(piece: str) -> None:
            thoughts.append(piece)
            if not self.hide_thinking:
                view.think(piece)

        try:
            if self.reader.take_interrupt():
                raise KeyboardInterrupt
            with keys_not_echoed(), MarkdownStream(console) if self.wordwrap else RawStream(console) as view:
                final = stream_reply(self.client.chat(request), show, think)
        except KeyboardInterrupt:
            interrupt_handled()
            console.print("[dim](stopped)[/]", highlight=False)
            if not parts:  # nothing was answered: the question goes too, so the history still alternates
                self.conversation.withdraw()
                return
        except LocalLLMError:
            if parts:
                self.conversation.answered("".join(parts))
            else:
                self.conversation.withdraw()
            raise
        self.conversation.answered("".join(parts), final, thinking="".join(thoughts))
        if final is not None and self.verbose:
            print_timings(final, to=err_console)

    def _take_images(self, text: str) -> str:
        """Attach the image files a vision model's message names and return its text without them. Every file is
        checked before any is attached, so a bad one leaves the message unsent and nothing half-attached."""
        mentions = find_image_files(text) if self._has_vision() else []
        images = [read_image_file(mention.path) for mention in mentions]
        for mention, image in zip(mentions, images, strict=True):
            self.images.append(image)
            console.print(f"Added image '{mention.path}'", highlight=False, markup=False)
        return cut_mentions(text, mentions)

    def _opens_with_image(self, text: str) -> bool:
        """Whether a line that starts with / is a message opening with an image's absolute path, not a command."""
        return any(mention.start == 0 for mention in find_image_files(text)) and self._has_vision()

    def _has_vision(self) -> bool:
        model = self.conversation.model
        if model not in self._vision:
            self._vision[model] = "vision" in self.client.show(model).capabilities
        return self._vision[model]

    # ----------------------------------------------------------------------------------------------- commands

    def _command(self, line: str) -> bool:
        name, rest = _split_first(line)
        handler = self._commands.get(name.lower())
        if handler is None:
            raise InvalidInput(f"unknown command {name!r}", hint="type /? for help")
        return handler(rest) is not False

    def _bye(self, rest: str) -> bool:
        return False

    def _help(self, rest: str) -> None:
        topics = {
            "": HELP,
            "set": HELP_SET,
            "show": HELP_SHOW,
            "shortcuts": HELP_SHORTCUTS,
            "shortcut": HELP_SHORTCUTS,
            "parameter": HELP_PARAMETERS,
            "parameters": HELP_PARAMETERS,
            "tools": HELP_TOOLS,
        }
        text = topics.get(rest.strip().lower().lstrip("/"))
        if text is None:
            raise InvalidInput(f"no help for {rest.strip()!r}", hint="type /? for the list of commands")
        console.print(text, highlight=False, markup=False)

    def _tools(self, rest: str) -> None:
        """/tools [on|off SERVER]: the MCP servers of this chat (cli/mcp_chat.py)."""
        if self.tools is None:
            from .mcp_chat import no_tools_message

            console.print(no_tools_message(), highlight=False, markup=False)
            return
        self.tools.command(rest)

    def _prompt(self, rest: str) -> None:
        """/prompt [NAME ARGS]: an MCP server's prompt, sent as the next message (cli/mcp_chat.py)."""
        if self.tools is None:
            self._tools("")
            return
        text = self.tools.prompt(rest)
        if text:
            console.print(text, style="dim", highlight=False, markup=False)
            self.ask(text)

    def _resource(self, rest: str) -> None:
        """/resource [URI]: attach an MCP server's resource to the next message (cli/mcp_chat.py)."""
        if self.tools is None:
            self._tools("")
        else:
            self.tools.resource(rest)

    def _image(self, rest: str) -> None:
        """/image PATH: read and check the image now (a wrong file is refused here, not after the question)."""
        if not rest.strip():
            raise InvalidInput("/image needs a file", hint="/image ./photo.png")
        path = Path(unquote(rest.strip())).expanduser()
        self.images.append(read_image_file(path))
        console.print(f"Added image '{path}' ({len(self.images)} for the next message)", highlight=False)

    def _clear(self, rest: str) -> None:
        self.conversation.clear()
        console.print("Cleared session context")

    def _set(self, rest: str) -> None:
        what, value = _split_first(rest)
        setters: dict[str, Callable[[str], None]] = {
            "parameter": self._set_parameter,
            "system": self._set_system,
            "format": self._set_format,
            "noformat": self._set_noformat,
            "verbose": self._set_verbose,
            "quiet": self._set_quiet,
            "history": self._set_history,
            "nohistory": self._set_nohistory,
            "wordwrap": self._set_wordwrap,
            "nowordwrap": self._set_nowordwrap,
            "think": self._set_think,
            "nothink": self._set_nothink,
        }
        setter = setters.get(what.lower())
        if setter is None:
            raise InvalidInput(
                f"unknown /set option {what!r}" if what else "/set needs an option", hint="type /? set for the list"
            )
        setter(value)

    def _set_parameter(self, value: str) -> None:
        words = value.split()
        if not words:
            console.print(HELP_PARAMETERS, highlight=False, markup=False)
            return
        typed = self.conversation.set_parameter(words[0], words[1:])
        console.print(f"Set parameter '{words[0]}' to '{_plain(typed)}'", highlight=False, markup=False)

    def _set_system(self, value: str) -> None:
        self.conversation.system = unquote(value) or None
        console.print("Set system message." if self.conversation.system else "Cleared system message.")

    def _set_format(self, value: str) -> None:
        if value.strip().lower() != "json":
            raise InvalidInput(f"format {value.strip()!r} is not supported", hint="/set format json")
        self.conversation.format = "json"
        console.print("Set format to 'json' mode.")

    def _set_noformat(self, value: str) -> None:
        self.conversation.format = None
        console.print("Disabled format.")

    def _set_think(self, value: str) -> None:
        level = value.strip().lower()
        self.conversation.set_think(level or True)
        console.print(f"Set 'think' mode{f' to {level!r}' if level else ''}.", highlight=False)

    def _set_nothink(self, value: str) -> None:
        self.conversation.set_think(False)
        console.print("Set 'nothink' mode.", highlight=False)

    def _set_verbose(self, value: str) -> None:
        self.verbose = True
        console.print("Set 'verbose' mode.")

    def _set_quiet(self, value: str) -> None:
        self.verbose = False
        console.print("Set 'quiet' mode.")

    def _set_history(self, value: str) -> None:
        self.reader.keep_history(True)
        console.print("Set 'history' mode.", highlight=False)

    def _set_nohistory(self, value: str) -> None:
        self.reader.keep_history(False)
        console.print("Set 'nohistory' mode.", highlight=False)

    def _set_wordwrap(self, value: str) -> None:
        self.wordwrap = True
        console.print("Set 'wordwrap' mode.", highlight=False)

    def _set_nowordwrap(self, value: str) -> None:
        self.wordwrap = False
        console.print("Set 'nowordwrap' mode.", highlight=False)

    def _show(self, rest: str) -> None:
        what = rest.strip().lower()
        if what == "parameters":
            self._show_parameters()
            return
        info = self.client.show(self.conversation.model)
        texts = {
            "template": info.template,
            "modelfile": info.modelfile,
            "license": info.license,
            "system": self.conversation.system or info.system,
        }
        if what == "info":
            print_model_facts(info, to=console)
        elif what in texts:
            console.print(texts[what] or f"No {what} was specified for this model.", highlight=False, markup=False)
        else:
            raise InvalidInput(
                f"unknown /show option {what!r}" if what else "/show needs an option", hint="type /? show for the list"
            )

    def _show_parameters(self) -> None:
        info = self.client.show(self.conversation.model)
        if self.conversation.options:
            console.print("User defined parameters:")
            for name, value in sorted(self.conversation.options.items()):
                console.print(f"{name:<24}{_plain(value)}", highlight=False, markup=False)
        console.print("Model defined parameters:")
        console.print(
            info.parameters or "No additional parameters were specified for this model.", highlight=False, markup=False
        )

    def _load(self, rest: str) -> None:
        name = rest.strip()
        if not name:
            raise InvalidInput("/load needs a model name", hint="/load MODEL")
        if is_prompt_cache_file(name):
            self._load_prompt_cache(Path(name).expanduser())
            return
        console.print(f"Loading model '{name}'", highlight=False)
        prepare_model(self.client, self.conversation.load_request().model_copy(update={"model": name}), to=console)
        self.conversation.switch_model(name)

    def _save(self, rest: str) -> None:
        name = rest.strip()
        if not name:
            raise InvalidInput("/save needs a name for the new model", hint="/save NAME")
        if is_prompt_cache_file(name):
            self._save_prompt_cache(Path(name).expanduser())
            return
        for _ in self.client.create(self.conversation.create_request(name)):
            pass
        console.print(f"Created new model '{name}'", highlight=False)

    def _save_prompt_cache(self, path: Path) -> None:
        if not self.conversation.messages:
            raise InvalidInput("nothing to save yet", hint="send a message first")
        state = self.client.save_prompt_cache(self.conversation.request())
        write_prompt_cache(path, self.conversation.session(), state)
        console.print(
            f"Saved this chat and its prompt cache to {path} ({len(state) / 2**20:.1f} MiB)",
            highlight=False,
            markup=False,
        )

    def _load_prompt_cache(self, path: Path) -> None:
        session, state = read_prompt_cache(path)
        request = api.ChatRequest(
            model=session.model, options=dict(session.options), keep_alive=self.conversation.keep_alive
        )
        prepare_model(self.client, request, to=console)
        tokens = self.client.load_prompt_cache(request, state)
        self.conversation.resume(session)
        console.print(
            f"Loaded a chat of {len(session.messages)} message(s) with {session.model}; {tokens} tokens "
            "of its prompt cache are ready",
            highlight=False,
            markup=False,
        )

    def _stats(self, rest: str) -> None:
        figures = self.conversation.figures
        if figures.last is not None:
            console.print("[bold]Last answer[/]")
            for label, value in timing_rows(figures.last):
                console.print(f"  {label + ':':<22}{value}", highlight=False, markup=False)
        console.print("[bold]This chat[/]")
        for label, value in _chat_rows(self.conversation):
            console.print(f"  {label + ':':<22}{value}", highlight=False, markup=False)
        for row in self.client.ps().models:
            if is_model(row, self.conversation.model):
                console.print("[bold]Engine[/]")
                for label, value in _engine_rows(row):
                    console.print(f"  {label + ':':<22}{value}", highlight=False, markup=False)


def _chat_rows(conversation: Conversation) -> list[tuple[str, str]]:
    f = conversation.figures
    speed = f.tokens_per_second
    rows = [
        ("answers", str(f.answers)),
        ("generated", f"{f.generated_tokens} token(s)"),
        ("eval rate", f"{speed:.2f} tokens/s" if speed is not None else "-"),
        (
            "prompt tokens",
            f"{f.prompt_tokens}, {f.cached_tokens} reused from cache"
            + (f" ({f.cache_share:.0%})" if f.cache_share is not None else ""),
        ),
    ]
    rows.append(
        (
            "speculation",
            f"{f.accepted}/{f.drafted} drafted tokens accepted ({f.acceptance:.0%})"
            if f.acceptance is not None
            else "none drafted",
        )
    )
    return rows


def _engine_rows(row: api.ProcessModel) -> list[tuple[str, str]]:
    acceptance = f", {row.draft_accepted}/{row.draft_count} accepted" if row.draft_count else ""
    return [
        ("backend", row.backend),
        ("slots", f"{row.slots_busy}/{row.slots_total} busy, {row.queue_depth} queued"),
        ("context", f"{row.context_length} tokens per slot"),
        ("kv cache", row.kv_type),
        ("speculation", row.speculation + acceptance),
    ]


def _split_first(text: str) -> tuple[str, str]:
    """("/set", "parameter temperature 0") from "/set parameter temperature 0"; the rest keeps its inner spacing."""
    parts = text.strip().split(None, 1)
    return (parts[0], parts[1]) if len(parts) == 2 else (parts[0] if parts else "", "")


def _plain(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
