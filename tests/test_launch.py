"""`localllm launch`: a stub agent on PATH prints the environment and arguments it was started with, against the
real server (on a loopback port, over the catalog models) that launch finds for this home (the test's LOCALLLM_HOME,
which the server reports on /health)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from server_harness import served

MODEL = "smollm2:135m"
SEEN = ("ANTHROPIC_", "CLAUDE_CODE_", "OPENAI_", "OPENCODE_")


def stub(folder: Path, name: str) -> None:
    """An executable `name` that prints its arguments and the variables launch sets, as JSON."""
    path = folder / name
    path.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import json, os, sys
            seen = {{k: v for k, v in os.environ.items() if k.startswith({SEEN!r})}}
            print(json.dumps({{"argv": sys.argv[1:], "env": seen}}))
            """
        )
    )
    path.chmod(0o755)


def launch(args: list[str], *, path: str, home: Path, url: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SEEN)}
    env.update(PATH=path, LOCALLLM_HOME=str(home))
    if url is not None:
        env["LOCALLLM_HOST"] = url.removeprefix("http://")
    return subprocess.run(
        [sys.executable, "-m", "localllm", "launch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def launch_url(models_home):
    with served(models_home, LOCALLLM_CONTEXT_LENGTH="512", LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("claude", "codex", "opencode"):
        stub(folder, name)
    return folder


def _path(folder: Path) -> str:
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.mark.models
def test_launch_claude_points_it_at_the_server(launch_url, bin_dir, isolated_home):
    done = launch(
        ["claude", "--model", MODEL, "--", "-p", "hi"], path=_path(bin_dir), home=isolated_home, url=launch_url
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["--model", MODEL, "-p", "hi"]
    env = seen["env"]
    assert env["ANTHROPIC_BASE_URL"] == launch_url and env["ANTHROPIC_AUTH_TOKEN"] and env["ANTHROPIC_API_KEY"] == ""
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == env["CLAUDE_CODE_SUBAGENT_MODEL"] == MODEL


@pytest.mark.models
def test_launch_codex_and_opencode(launch_url, bin_dir, isolated_home):
    codex = launch(["codex", "-m", MODEL], path=_path(bin_dir), home=isolated_home, url=launch_url)
    assert codex.returncode == 0, codex.stderr
    seen = json.loads(codex.stdout)
    assert seen["env"]["OPENAI_BASE_URL"] == launch_url + "/v1" and seen["env"]["OPENAI_API_KEY"]
    argv = seen["argv"]
    assert argv[-2:] == ["-m", MODEL] and 'model_provider="localllm"' in argv
    provider = next(a for a in argv if a.startswith("model_providers.localllm="))
    assert f'base_url = "{launch_url}/v1"' in provider and 'wire_api = "responses"' in provider

    opencode = launch(["opencode", "--model", MODEL], path=_path(bin_dir), home=isolated_home, url=launch_url)
    assert opencode.returncode == 0, opencode.stderr
    settings = json.loads(json.loads(opencode.stdout)["env"]["OPENCODE_CONFIG_CONTENT"])
    assert settings["model"] == f"localllm/{MODEL}"
    assert settings["provider"]["localllm"]["options"]["baseURL"] == launch_url + "/v1"
    assert MODEL in settings["provider"]["localllm"]["models"]


def test_launch_refuses_what_it_cannot_start(tmp_path, isolated_home):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = launch(["claude", "--model", MODEL], path=str(empty), home=isolated_home)
    assert missing.returncode == 1 and "Claude Code is not installed" in missing.stderr
    assert "npm install -g @anthropic-ai/claude-code" in missing.stderr
    unknown = launch(["cursor"], path=str(empty), home=isolated_home)
    assert unknown.returncode == 1 and "unknown agent 'cursor'" in unknown.stderr


@pytest.mark.models
def test_launch_without_a_model_name_off_a_terminal(launch_url, bin_dir, isolated_home):
    done = launch(["claude"], path=_path(bin_dir), home=isolated_home, url=launch_url)
    assert done.returncode == 1 and "--model" in done.stderr
