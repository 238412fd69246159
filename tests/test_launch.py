"""`localllm launch`: a stub agent on PATH prints the environment and arguments it was started with, against the
real server (on a loopback port, over the catalog models) that launch finds for this home (the test's LOCALLLM_HOME,
which the server reports on /health). The agents' config files go to a fake HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import tomllib
from conftest import CODER_TEST_MODEL
from server_harness import served

MODEL = "smollm2:135m"  # trained for 8,192 tokens
CODER = CODER_TEST_MODEL  # trained for 32,768
SEEN = ("ANTHROPIC_", "CLAUDE_", "API_TIMEOUT_MS", "OPENAI_", "OPENCODE_", "OLLAMA_", "LOCALLLM_AGENT_")
AGENT_COMMANDS = ("claude", "codex", "opencode", "qwen", "cn", "aider")
# Where the agents keep their settings: launch must find them under the test's HOME only.
MOVED = ("XDG_CONFIG_HOME", "CODEX_HOME", "CLAUDE_CONFIG_DIR")


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


def launch(
    args: list[str], *, path: str, home: Path, url: str | None = None, user: Path | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SEEN) and k not in MOVED}
    env.update(PATH=path, LOCALLLM_HOME=str(home))
    if user is not None:
        env["HOME"] = str(user)
    if url is not None:
        env["LOCALLLM_HOST"] = url.removeprefix("http://")
    return subprocess.run(
        [sys.executable, "-m", "localllm", "launch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def launch_url(coder_home):
    with served(coder_home, LOCALLLM_CONTEXT_LENGTH="512", LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in AGENT_COMMANDS:
        stub(folder, name)
    return folder


@pytest.fixture
def user(tmp_path) -> Path:
    """The agents' HOME."""
    folder = tmp_path / "user"
    folder.mkdir()
    return folder


def _path(folder: Path) -> str:
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def _loaded_context(url: str, model: str) -> int | None:
    rows = httpx.get(url + "/api/ps").json()["models"]
    return next((row["context_length"] for row in rows if row["name"] == model), None)


def _unload(url: str, model: str) -> None:
    httpx.post(url + "/api/generate", json={"model": model, "keep_alive": 0, "stream": False}, timeout=60)


@pytest.mark.models
def test_launch_claude_loads_the_trained_context_and_tells_claude(launch_url, bin_dir, isolated_home, user):
    _unload(launch_url, CODER)
    done = launch(
        ["claude", "--model", CODER, "--", "-p", "hi"],
        path=_path(bin_dir),
        home=isolated_home,
        url=launch_url,
        user=user,
    )
    assert done.returncode == 0, done.stderr
    # The context chosen, and the memory plan for it, are shown before the agent starts.
    assert f"{CODER}: context 32,768 tokens" in done.stderr and "trained for 32,768" in done.stderr
    assert "memory: " in done.stderr and "KV cache" in done.stderr and "warning" not in done.stderr
    assert _loaded_context(launch_url, CODER) == 32_768  # loaded with it before the agent's first request
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["--model", CODER, "-p", "hi"]
    env = seen["env"]
    assert env["ANTHROPIC_BASE_URL"] == launch_url and env["ANTHROPIC_AUTH_TOKEN"] and env["ANTHROPIC_API_KEY"] == ""
    roles = ("MODEL", "DEFAULT_OPUS_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_HAIKU_MODEL", "SMALL_FAST_MODEL")
    assert {env[f"ANTHROPIC_{role}"] for role in roles} == {env["CLAUDE_CODE_SUBAGENT_MODEL"]} == {CODER}
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "32768"
    assert int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) < 32_768
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["CLAUDE_CODE_TOTAL_TOKENS_REMINDER"] == "off"
    assert int(env["API_TIMEOUT_MS"]) >= 600_000 and int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) >= 600_000
    assert not (user / ".claude").exists()  # a launch passes variables; only --config writes settings.json


@pytest.mark.models
def test_a_model_trained_for_less_is_loaded_with_that_and_the_agent_warned(launch_url, bin_dir, isolated_home, user):
    done = launch(["claude", "--model", MODEL], path=_path(bin_dir), home=isolated_home, url=launch_url, user=user)
    assert done.returncode == 0, done.stderr
    assert f"{MODEL}: context 8,192 tokens (bounded by its trained context" in done.stderr
    assert "warning: Claude Code's first request" in done.stderr
    assert json.loads(done.stdout)["env"]["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "8192"

    asked = launch(
        ["claude", "--model", MODEL, "--context", "4096"], path=_path(bin_dir), home=isolated_home, url=launch_url
    )
    assert asked.returncode == 0 and "context 4,096 tokens (bounded by --context" in asked.stderr
    over = launch(
        ["claude", "--model", MODEL, "--context", "16384"], path=_path(bin_dir), home=isolated_home, url=launch_url
    )
    assert (
        over.returncode == 1 and "--context 16384 is over 8192, the context smollm2:135m was trained on" in over.stderr
    )


@pytest.mark.models
def test_launch_codex_writes_its_profile(launch_url, bin_dir, isolated_home, user):
    done = launch(["codex", "-m", CODER], path=_path(bin_dir), home=isolated_home, url=launch_url, user=user)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["argv"] == ["--profile", "localllm"]
    profile = tomllib.loads((user / ".codex" / "localllm.config.toml").read_text())
    assert profile["model"] == profile["review_model"] == CODER and profile["model_provider"] == "localllm"
    assert profile["model_context_window"] == 32_768 and profile["model_auto_compact_token_limit"] < 32_768
    provider = profile["model_providers"]["localllm"]
    assert provider["base_url"] == launch_url + "/v1" and provider["wire_api"] == "responses"
    assert provider["stream_idle_timeout_ms"] >= 600_000 and "env_key" not in provider  # the server wants no key


@pytest.mark.models
def test_launch_opencode_qwen_continue_and_aider(launch_url, bin_dir, isolated_home, user):
    opencode = launch(["opencode", "--model", CODER], path=_path(bin_dir), home=isolated_home, url=launch_url)
    assert opencode.returncode == 0, opencode.stderr
    settings = json.loads(json.loads(opencode.stdout)["env"]["OPENCODE_CONFIG_CONTENT"])
    assert settings["model"] == settings["small_model"] == f"localllm/{CODER}"
    provider = settings["provider"]["localllm"]
    assert provider["options"]["baseURL"] == launch_url + "/v1" and provider["options"]["timeout"] >= 600_000
    assert provider["models"][CODER]["limit"]["context"] == 32_768

    # Qwen Code: its settings.json gains the provider; what the user had stays.
    qwen_settings = user / ".qwen" / "settings.json"
    qwen_settings.parent.mkdir()
    mine = {"openai": [{"id": "gpt-9", "envKey": "MY_KEY"}]}
    qwen_settings.write_text(json.dumps({"theme": "dark", "modelProviders": mine, "memory": {"mine": 1}}))
    qwen = launch(["qwen", "--model", CODER], path=_path(bin_dir), home=isolated_home, url=launch_url, user=user)
    assert qwen.returncode == 0, qwen.stderr
    written = json.loads(qwen_settings.read_text())
    entry, kept = written["modelProviders"]["openai"]
    assert entry["id"] == CODER and entry["baseUrl"] == launch_url + "/v1" and kept["id"] == "gpt-9"
    assert written["security"]["auth"]["selectedType"] == "openai" and written["model"]["name"] == CODER
    assert written["theme"] == "dark" and json.loads(qwen.stdout)["env"][entry["envKey"]]
    # Its managed auto-memory off (a request of its own after every turn), unless the user chose.
    assert written["memory"] == {"mine": 1, "enableManagedAutoMemory": False}

    continue_ = launch(
        ["continue", "--model", CODER], path=_path(bin_dir), home=isolated_home, url=launch_url, user=user
    )
    assert continue_.returncode == 0, continue_.stderr
    config_path = user / ".continue" / "localllm.yaml"
    assert json.loads(continue_.stdout)["argv"] == ["--config", str(config_path)]
    (model,) = json.loads(config_path.read_text())["models"]  # JSON is YAML
    assert model["apiBase"] == launch_url + "/v1" and model["defaultCompletionOptions"]["contextLength"] == 32_768

    aider = launch(["aider", "--model", CODER], path=_path(bin_dir), home=isolated_home, url=launch_url, user=user)
    assert aider.returncode == 0, aider.stderr
    seen = json.loads(aider.stdout)
    assert seen["env"]["OLLAMA_API_BASE"] == launch_url and seen["argv"][:2] == ["--model", f"ollama_chat/{CODER}"]
    model_settings = json.loads((user / ".aider.localllm.model.settings.yml").read_text())
    assert model_settings == [{"name": f"ollama_chat/{CODER}", "extra_params": {"num_ctx": 32_768}}]


@pytest.mark.models
def test_config_writes_without_launching_and_restore_puts_back(launch_url, tmp_path, isolated_home, user):
    empty = tmp_path / "empty"  # --config needs no agent installed
    empty.mkdir()
    claude_settings = user / ".claude" / "settings.json"
    claude_settings.parent.mkdir()
    original = json.dumps({"theme": "dark", "env": {"KEEP": "1"}})
    claude_settings.write_text(original)

    done = launch(
        ["claude", "--config", "--model", MODEL], path=str(empty), home=isolated_home, url=launch_url, user=user
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and f"wrote {claude_settings}" in done.stderr and "start it with: claude" in done.stderr
    written = json.loads(claude_settings.read_text())
    assert written["theme"] == "dark" and written["env"]["KEEP"] == "1"
    assert written["env"]["ANTHROPIC_BASE_URL"] == launch_url and written["env"]["ANTHROPIC_MODEL"] == MODEL
    # A second --config keeps the first backup: restore returns to the user's own file.
    again = launch(
        ["claude", "--config", "--model", CODER], path=str(empty), home=isolated_home, url=launch_url, user=user
    )
    assert again.returncode == 0, again.stderr

    codex = launch(
        ["codex", "--config", "--model", MODEL], path=str(empty), home=isolated_home, url=launch_url, user=user
    )
    assert codex.returncode == 0 and "start it with: codex --profile localllm" in codex.stderr
    assert (user / ".codex" / "localllm.config.toml").is_file()

    restored = launch(["claude", "--restore"], path=str(empty), home=isolated_home, user=user)
    assert restored.returncode == 0 and f"restored {claude_settings}" in restored.stderr
    assert claude_settings.read_text() == original
    removed = launch(["codex", "--restore"], path=str(empty), home=isolated_home, user=user)
    assert removed.returncode == 0 and not (user / ".codex" / "localllm.config.toml").exists()
    assert sorted(p.name for p in (user / ".codex").iterdir()) == []
    nothing = launch(["claude", "--restore"], path=str(empty), home=isolated_home, user=user)
    assert nothing.returncode == 0 and "nothing to restore" in nothing.stderr


def test_launch_refuses_what_it_cannot_start(tmp_path, isolated_home):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = launch(["claude", "--model", MODEL], path=str(empty), home=isolated_home)
    assert missing.returncode == 1 and "Claude Code is not installed" in missing.stderr
    assert "npm install -g @anthropic-ai/claude-code" in missing.stderr
    unknown = launch(["cursor"], path=str(empty), home=isolated_home)
    assert unknown.returncode == 1 and "unknown agent 'cursor'" in unknown.stderr
    cline = launch(["cline"], path=str(empty), home=isolated_home)
    assert (
        cline.returncode == 1 and "launch cannot set up cline" in cline.stderr and "OpenAI Compatible" in cline.stderr
    )


def test_a_user_file_that_is_not_json_is_left_alone(user):
    from localllm.cli.agent_files import json_merged, merge, write
    from localllm.errors import InvalidInput

    settings = user / "settings.json"
    settings.write_text('{"theme": "dark", // mine\n}')
    with pytest.raises(InvalidInput, match="is not plain JSON"):
        write([json_merged(settings, lambda old: merge(old, {"env": {}}))])
    assert settings.read_text() == '{"theme": "dark", // mine\n}'
    assert not settings.with_name("settings.json.localllm-backup").exists()


@pytest.mark.models
def test_launch_without_a_model_name_off_a_terminal(launch_url, bin_dir, isolated_home):
    done = launch(["claude"], path=_path(bin_dir), home=isolated_home, url=launch_url)
    assert done.returncode == 1 and "--model" in done.stderr


@pytest.mark.models
def test_a_smaller_context_is_served_by_the_loaded_model(launch_url):
    """aider asks a different num_ctx on every request: one no larger than the loaded model's does not reload it."""

    def generate(num_ctx: int) -> dict:
        body = {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_ctx": num_ctx, "num_predict": 1}}
        response = httpx.post(launch_url + "/api/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    _unload(launch_url, MODEL)
    generate(2048)
    assert _loaded_context(launch_url, MODEL) == 2048
    generate(1024)
    assert _loaded_context(launch_url, MODEL) == 2048  # kept: a reload would show 1024
    # served by the larger load, a request still runs in its own context: refused, or cut, as at its own size
    long = {"model": MODEL, "prompt": "word " * 400, "stream": False, "options": {"num_ctx": 256, "num_predict": 4}}
    refused = httpx.post(launch_url + "/api/generate", json=long, timeout=120)
    assert refused.status_code == 400 and "the context holds 256" in refused.json()["error"], refused.text
    cut = httpx.post(launch_url + "/api/generate", json={**long, "truncate": True}, timeout=120)
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] < 256, cut.text
    assert _loaded_context(launch_url, MODEL) == 2048
    generate(4096)
    assert _loaded_context(launch_url, MODEL) == 4096  # a larger one reloads
