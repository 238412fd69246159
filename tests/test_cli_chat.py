"""`localllm run`, `ps` and `stop` as a user meets them: the chat driven through a pseudo-terminal (pexpect), one-shot
answers from arguments and piped stdin, and the background server that a first `run` starts and later ones reuse.

Every command runs in a child process on a home that links the session's catalog models, with its own loopback port;
the background server is killed at the end. The pure pieces (markdown block splitting, multi-line input, parameter
parsing) are tested table-driven at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pexpect
import pytest
from server_harness import free_port, linked_home

from localllm.cli.image_files import cut_mentions, find_image_files
from localllm.cli.line_input import read_message, unquote
from localllm.cli.render import split_finished
from localllm.conversation import parse_parameter
from localllm.errors import InvalidInput

PROMPT = ">>> "
SYSTEM = "You are a helpful AI assistant."
QUESTION = "What is the capital of France?"


# ---------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def chat_home(models_home, tmp_path_factory) -> Path:
    """A home of its own (history, logs, saved models) whose blobs link to the session's catalog models."""
    return linked_home(models_home, tmp_path_factory.mktemp("chat") / "home")


@dataclass
class Served:
    home: Path
    url: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def served(chat_home) -> Served:
    """An environment whose LOCALLLM_HOST is a free loopback port; the server a `run` starts there is killed after."""
    port = free_port()
    env = _child_env(chat_home, LOCALLLM_HOST=f"127.0.0.1:{port}")
    yield Served(chat_home, f"http://127.0.0.1:{port}", env)
    _kill_server(chat_home / "server.pid")


def _child_env(home: Path, **extra: str) -> dict[str, str]:
    # LOCALLLM_REGISTRY stays: conftest points it at a closed loopback port, so no child asks a real registry
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALLLM_") or k == "LOCALLLM_REGISTRY"}
    # A pty answers no cursor-position queries; without this prompt_toolkit waits for them and then warns.
    env.update(LOCALLLM_HOME=str(home), TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", **extra)
    return env


def _kill_server(pid_file: Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(100):
            if not _alive(pid):
                return
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def localllm(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "localllm", *args], env=env, input=stdin, capture_output=True, text=True, timeout=180
    )


def _as_in_a_terminal() -> None:
    # A job started in the background of a non-interactive shell (as CI may be) inherits SIGINT ignored, and Python
    # then never raises KeyboardInterrupt; a person's terminal delivers Ctrl-C with the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_chat(env: dict[str, str], *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "localllm", "run", *args],
        env=env,
        encoding="utf-8",
        timeout=90,
        dimensions=(40, 120),
        preexec_fn=_as_in_a_terminal,
    )
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn, line: str, *expected: str) -> None:
    """Send a line; wait for each expected text in order, then for the next prompt."""
    child.sendline(line)
    for text in expected:
        child.expect_exact(text)
    child.expect_exact(PROMPT)


def wait_until_busy(url: str) -> None:
    """Poll /api/ps until a slot is decoding (the chat's request reached the server)."""
    for _ in range(1200):
        if any(m["slots_busy"] for m in httpx.get(f"{url}/api/ps", timeout=5).json()["models"]):
            return
        time.sleep(0.05)
    raise AssertionError("no slot became busy")


def wait_until_idle(url: str) -> list[dict]:
    """Poll /api/ps until no slot is busy (the server has seen the cancel); returns the loaded models."""
    for _ in range(100):
        models = httpx.get(f"{url}/api/ps", timeout=5).json()["models"]
        if all(m["slots_busy"] == 0 for m in models):
            return models
        time.sleep(0.1)
    raise AssertionError(f"a slot stayed busy: {models}")


# ---------------------------------------------------------------------------------------------------------- chat


def test_terminal_chat_through_the_background_server(served):
    child = spawn_chat(served.env, "smollm2:135m")
    assert (served.home / "server.pid").exists()  # no server answered, so `run` started one
    say(child, f"/set system {SYSTEM}", "Set system message.")
    say(child, "/set parameter temperature 0", "Set parameter 'temperature' to '0.0'")
    say(child, "/set parameter num_predict 40", "Set parameter 'num_predict' to '40'")
    say(child, "/show parameters", "User defined parameters:", "num_predict", "temperature", "0.0")
    say(child, QUESTION, "Paris")

    # bad input is one line and the chat goes on
    say(child, "/set parameter temperature hot", "Error:", "parameter temperature 'hot'")
    say(child, "/set parameter temprature 1", "did you mean 'temperature'")
    say(child, "/nonsense", "unknown command '/nonsense'")
    say(child, "/load nosuch:1b", "Error:", "not in the catalog")
    say(child, "/show info", "architecture", "llama")

    # Ctrl-C stops a long answer (and frees its slot on the server); the chat goes on. EOS is banned so the answer
    # is surely still running when Ctrl-C arrives (a greedy story can end within a second).
    say(child, "/set parameter num_predict 1500")
    say(child, "/set parameter ignore_eos true", "Set parameter 'ignore_eos'")
    child.sendline("Write a very long story about a dragon.")
    wait_until_busy(served.url)  # the answer is being written (a spinner may never show when it starts at once)
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    assert [m["name"] for m in wait_until_idle(served.url)] == ["smollm2:135m"]
    say(child, "/set parameter ignore_eos false", "Set parameter 'ignore_eos'")
    say(child, "/clear", "Cleared session context")
    say(child, "/set parameter num_predict 40")
    say(child, QUESTION, "Paris")

    # multi-line input, then the session saved as a model and loaded again
    child.sendline('"""')
    child.expect_exact("... ")
    child.sendline("Say hello")
    child.expect_exact("... ")
    say(child, 'in one word."""')
    say(child, "/save test/chat-session", "Created new model 'test/chat-session'")
    say(child, "/load test/chat-session", "Loading model 'test/chat-session'")
    say(child, "/show modelfile", "SYSTEM", "PARAMETER temperature 0", "MESSAGE user")
    say(child, "/stats", "Last answer", "eval rate", "This chat", "Engine", "slots")

    child.sendintr()  # at an empty prompt: a hint, not an exit
    child.expect_exact("Use Ctrl + d or /bye to exit.")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_d_ends_the_chat_with_exit_code_0(chat_home):
    child = spawn_chat(_child_env(chat_home), "smollm2:135m", "--in-process")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_run_pulls_a_missing_model_with_a_progress_bar_then_chats(tmp_path, smollm2_path):
    from hfserver import Hub, HubServer

    hub = Hub(repos={"test/chat": {"chat.Q4_1.gguf": smollm2_path.read_bytes()}})
    with HubServer(hub) as url:
        child = spawn_chat(_child_env(tmp_path / "empty-home", HF_ENDPOINT=url), "hf.co/test/chat:Q4_1", "--in-process")
    shown = child.before
    assert "pulling" in shown and "98.4/98.4 MB" in shown and "success" in shown
    assert "loading hf.co/test/chat:Q4_1" in shown
    say(child, "/show info", "quantization", "Q4_1")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_verbose_prints_timings_after_each_answer(chat_home):
    child = spawn_chat(_child_env(chat_home), "smollm2:135m", "--in-process", "--verbose")
    say(child, "/set parameter num_predict 4")
    say(child, "Hi", "prompt eval count:", "prompt cache:", "eval rate:")
    child.sendline("/bye")
    child.expect(pexpect.EOF)


# ---------------------------------------------------------------------------------------------------------- one-shot


def test_one_shot_streams_the_answer_and_reuses_the_running_server(served, tmp_path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM smollm2:135m\nSYSTEM {SYSTEM}\nPARAMETER temperature 0\nPARAMETER num_predict 40\n")
    assert localllm(served.env, "create", "test/helpful", "-f", str(modelfile)).returncode == 0

    first = localllm(served.env, "run", "test/helpful", QUESTION)
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout
    assert "loading" not in first.stdout  # progress and spinners go to stderr, the answer alone to stdout
    pid = (served.home / "server.pid").read_text()

    piped = localllm(served.env, "run", "test/helpful", stdin=QUESTION + "\n")
    assert piped.returncode == 0, piped.stderr
    assert "Paris" in piped.stdout
    assert (served.home / "server.pid").read_text() == pid  # the running server was reused, none started

    listed = json.loads(localllm(served.env, "ps", "--json").stdout)["models"]
    assert "test/helpful:latest" in [m["name"] for m in listed]
    table = localllm(served.env, "ps").stdout
    assert "test/helpful:latest" in table and "CTX/SLOT" in table

    assert localllm(served.env, "stop", "test/helpful").returncode == 0
    listed = json.loads(localllm(served.env, "ps", "--json").stdout)["models"]
    assert "test/helpful:latest" not in [m["name"] for m in listed]
    again = localllm(served.env, "stop", "test/helpful")
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == ["Error: model 'test/helpful' is not loaded (see `localllm ps`)"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "nosuch:1b", "hi", "--in-process"], "model 'nosuch:1b' is not in the catalog"),
        (["run", "smollm2:135m", "hi", "--keepalive", "soon", "--in-process"], "--keepalive 'soon' is not valid"),
        (["run", "smollm2:135m", "hi", "--format", "yaml", "--in-process"], "--format 'yaml' is not supported"),
    ],
)
def test_bad_input_to_run_is_one_line_and_exit_code_1(chat_home, args, message):
    result = localllm(_child_env(chat_home), *args)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]


def test_ps_and_stop_without_a_server(chat_home):
    env = _child_env(chat_home, LOCALLLM_HOST=f"127.0.0.1:{free_port()}")
    listed = localllm(env, "ps", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == {"models": [], "load_queue": 0}
    assert "no localllm server answers" in listed.stderr
    stopped = localllm(env, "stop", "smollm2:135m")
    assert stopped.returncode == 1 and "no localllm server answers" in stopped.stderr


# ---------------------------------------------------------------------------------------------------------- pieces


@pytest.mark.parametrize(
    "text, finished, rest",
    [
        ("Hello", "", "Hello"),
        ("Hello\n\nWorld", "Hello\n\n", "World"),
        ("one\ntwo\n\nthree\n\nfou", "one\ntwo\n\nthree\n\n", "fou"),
        ("Intro\n\n```py\nx = 1\n\ny = 2\n", "Intro\n\n", "```py\nx = 1\n\ny = 2\n"),  # no split inside a fence
        ("```py\nx = 1\n```\nAfter", "```py\nx = 1\n```\n", "After"),  # a closed fence is finished
        ("text\n\n", "text\n\n", ""),
    ],
)
def test_streamed_markdown_is_printed_block_by_block(text, finished, rest):
    assert split_finished(text) == (finished, rest)


@pytest.mark.parametrize(
    "lines, message",
    [
        (["hello"], "hello"),
        (['"""one line"""'], '"""one line"""'),
        (['"""', "first", 'second"""'], '"""\nfirst\nsecond"""'),
        (['/set system """You are', 'a pirate."""'], '/set system """You are\na pirate."""'),
    ],
)
def test_triple_quotes_span_lines(lines, message):
    feed = iter(lines)
    assert read_message(lambda prompt: next(feed)) == message


@pytest.mark.parametrize(
    "text, plain",
    [
        ('"""\nfirst\nsecond"""', "first\nsecond"),
        ('"a pirate"', "a pirate"),
        ("plain words", "plain words"),
    ],
)
def test_quotes_are_removed_once(text, plain):
    assert unquote(text) == plain


@pytest.mark.parametrize(
    "name, words, value",
    [
        ("temperature", ["0"], 0.0),
        ("num_predict", ["12"], 12),
        ("num_ctx", ["2048"], 2048),
        ("stop", ["<|im_end|>", "###"], ["<|im_end|>", "###"]),
        ("seed", ["42"], 42),
    ],
)
def test_set_parameter_values_are_typed(name, words, value):
    assert parse_parameter(name, words) == value


@pytest.mark.parametrize(
    "name, words, message",
    [
        ("temperature", ["hot"], "parameter temperature 'hot'"),
        ("temperature", ["-1"], "greater than or equal to 0"),
        ("temprature", ["1"], "did you mean 'temperature'"),
        ("top_k", [], "needs a value"),
        ("mirostat", ["1"], "has no effect"),
    ],
)
def test_bad_set_parameter_names_the_value(name, words, message):
    with pytest.raises(InvalidInput, match=message):
        parse_parameter(name, words)


@pytest.mark.parametrize(
    "typed, found, rest",
    [
        ("What is in ./cat.png?", ["cat.png"], "What is in?"),
        ("Describe '{home}/my photo.png' please", ["my photo.png"], "Describe please"),
        ('Compare "cat.png" with my\\ photo.png.', ["cat.png", "my photo.png"], "Compare with."),
        ("~/cat.png", ["cat.png"], ""),
        ("{home}/album/Dog.JPEG and a\\(1\\).webp", ["Dog.JPEG", "a(1).webp"], "and"),
        ("Rename it to final.png", [], "Rename it to final.png"),  # no such file: just a word
        ("cat.png.bak and cat.pngs", [], "cat.png.bak and cat.pngs"),
        ("album.png is a folder", [], "album.png is a folder"),
    ],
)
def test_image_files_named_in_a_message(tmp_path, monkeypatch, typed, found, rest):
    (tmp_path / "album").mkdir()
    (tmp_path / "album.png").mkdir()
    for name in ("cat.png", "my photo.png", "album/Dog.JPEG", "a(1).webp"):
        (tmp_path / name).write_bytes(b"")  # only the names count here: the chat checks the bytes when it reads them
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    text = typed.format(home=tmp_path)
    mentions = find_image_files(text)
    assert [mention.path.name for mention in mentions] == found
    assert all(mention.path.is_file() for mention in mentions)
    assert cut_mentions(text, mentions) == rest
