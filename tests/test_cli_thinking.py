"""Thinking in the terminal: `run --think[=level]`, `--hidethinking`, `/set think` and `/set nothink`, with smollm2
under a reasoning template (tests/reasoning_model.py) run in-process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from localllm.cli import bare_think

QUESTION = "What is the capital of France?"
PROMPT = ">>> "
DIMMED_PARIS = re.compile(r"\x1b\[2m[^\x1b]*Paris")  # Paris in dimmed text


@pytest.fixture(scope="module")
def reasoner(reasoner_path) -> str:
    return str(reasoner_path)


def child_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALLLM_")}
    env.update(
        LOCALLLM_HOME=str(home),
        LOCALLLM_CONTEXT_LENGTH="512",
        LOCALLLM_NUM_PARALLEL="1",
        TERM="xterm-256color",
        PROMPT_TOOLKIT_NO_CPR="1",
    )
    return env


def run(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "localllm", "run", *args, "--in-process"],
        env=child_env(home),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_bare_think_reads_as_true():
    assert bare_think(["run", "m", "--think", "hi"]) == ["run", "m", "--think=true", "hi"]
    assert bare_think(["run", "m", "--think=low"]) == ["run", "m", "--think=low"]
    assert bare_think(["run", "m", "--", "--think"]) == ["run", "m", "--", "--think"]


@pytest.mark.models
def test_show_lists_the_thinking_capability(reasoner, tmp_path):
    shown = subprocess.run(
        [sys.executable, "-m", "localllm", "show", reasoner],
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    capabilities = shown.stdout.split("Capabilities")[1].split("Template")[0].split()
    assert capabilities == ["completion", "thinking"]


@pytest.mark.models
@pytest.mark.slow
def test_one_shot_thinking_goes_to_stderr_unless_hidden(reasoner, tmp_path):
    # A one-shot run has no sampling flags: a model of our own answers greedily, so every run says the same.
    (tmp_path / "Modelfile").write_text(f"FROM {reasoner}\nPARAMETER temperature 0\n")
    created = subprocess.run(
        [sys.executable, "-m", "localllm", "create", "greedy-reasoner", "-f", str(tmp_path / "Modelfile")],
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert created.returncode == 0, created.stderr
    reasoner = "greedy-reasoner"
    fixed = ["--think", QUESTION]
    shown = run(tmp_path, reasoner, *fixed)
    assert shown.returncode == 0, shown.stderr
    assert "Paris" in shown.stderr and "<think>" not in shown.stderr + shown.stdout
    assert shown.stdout.strip() == ""  # the model never closed its think block: no answer, only thinking
    hidden = run(tmp_path, reasoner, "--hidethinking", *fixed)
    assert hidden.returncode == 0 and "Paris" not in hidden.stderr
    off = run(tmp_path, reasoner, "--think=false", QUESTION)
    assert off.returncode == 0 and "Paris" in off.stdout and "<think>" not in off.stdout


@pytest.mark.models
@pytest.mark.parametrize(
    "args, message",
    [
        (["--think=loud", "hi"], "--think=loud is not valid"),
        (["--think", "hi"], "does not support thinking"),
    ],
)
def test_bad_think_is_one_line_and_exit_code_1(reasoner, smollm2_path, tmp_path, args, message):
    plain = tmp_path / "plain.gguf"  # smollm2 as it is: its template cannot think
    plain.symlink_to(smollm2_path)
    model = str(plain) if message.startswith("does not") else reasoner
    result = run(tmp_path, model, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and lines[-1].startswith("Error: ") and message in lines[-1]


def ask(child: pexpect.spawn, question: str) -> str:
    """What the chat drew for the answer to `question`, up to the next prompt."""
    child.sendline(question)
    child.expect_exact("Paris")
    shown = child.before + "Paris"
    child.expect_exact(PROMPT)
    return shown + child.before


@pytest.mark.models
def test_set_think_and_nothink_in_the_chat(reasoner, tmp_path):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "localllm", "run", reasoner, "--in-process"],
        env=child_env(tmp_path),
        encoding="utf-8",
        timeout=90,
        dimensions=(40, 120),
    )
    child.expect_exact(PROMPT)
    for line, reply in (
        ("/set parameter temperature 0", "Set parameter"),
        ("/set parameter num_predict 24", "Set"),
        ("/set nothink", "Set 'nothink' mode."),
    ):
        child.sendline(line)
        child.expect_exact(reply)
        child.expect_exact(PROMPT)
    assert not DIMMED_PARIS.search(ask(child, QUESTION))  # the answer, drawn as markdown
    child.sendline("/set think high")
    child.expect_exact("Set 'think' mode to 'high'.")
    child.expect_exact(PROMPT)
    shown = ask(child, QUESTION)
    assert DIMMED_PARIS.search(shown) and "<think>" not in shown  # the thinking, dimmed
    child.sendline("/bye")
    child.expect(pexpect.EOF)
