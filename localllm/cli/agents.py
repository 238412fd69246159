"""What `localllm launch` tells each coding agent: the server, the key, the model for every role the agent has, the
context window the model was loaded with, and timeouts long enough for a CPU's prefill.

Each agent gets it the way its documentation describes: variables and flags for the one launch, and config files
(written reversibly, agent_files.py) where the agent reads its provider only from a file. `--config` also writes the
files that make the bare command (`claude`, `opencode`) use localllm later.

Names checked against the agents' documentation, except where a comment says otherwise."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .agent_files import ConfigFile, json_merged, merge, whole

# A request may spend minutes in prefill on a CPU before its first token; the agents' defaults give up sooner.
REQUEST_TIMEOUT_MS = 60 * 60 * 1000
STREAM_IDLE_MS = 30 * 60 * 1000  # Claude Code clamps its stream idle limit to this
KEY_VARIABLE = "LOCALLLM_API_KEY"


@dataclass(frozen=True)
class Setup:
    """What launch chose: the server's root URL, the key to send, the model and the context it is loaded with."""

    url: str
    key: str
    keyed: bool  # the server requires the key (LOCALLLM_API_KEY is set), so files name the variable, not the value
    model: str
    context: int

    @property
    def api(self) -> str:
        return self.url + "/v1"

    @property
    def output(self) -> int:
        """Tokens an agent may ask for one reply: a quarter of the window, so a long prompt still has room."""
        return max(256, min(16_384, self.context // 4))


@dataclass(frozen=True)
class Agent:
    """One coding agent: its command and how to point it at localllm.

    `least` is the context its first request needs (its system prompt and tools), below which that request is refused
    as overflowing; `files` are written before every launch, `saved` only by `--config`; `paths` lists them all (for
    `--restore`, which has no Setup)."""

    command: str
    title: str
    install: str
    least: int
    env: Callable[[Setup], dict[str, str]]
    args: Callable[[Setup], list[str]]
    paths: Callable[[], list[Path]]
    files: Callable[[Setup], list[ConfigFile]] = field(default=lambda setup: [])
    saved: Callable[[Setup], list[ConfigFile]] = field(default=lambda setup: [])
    # Variables to start it with after `--config` (no file of the agent's holds them); a key shows as its variable.
    start_env: Callable[[Setup], dict[str, str]] = field(default=lambda setup: {})


def _home() -> Path:
    return Path.home()


def _folder(variable: str, default: Path) -> Path:
    value = os.environ.get(variable)
    return Path(value).expanduser() if value else default


# ---------------------------------------------------------------------------------------------------------- claude


def _claude_settings() -> Path:
    return _folder("CLAUDE_CONFIG_DIR", _home() / ".claude") / "settings.json"


def _claude_env(setup: Setup) -> dict[str, str]:
    roles = (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",  # the haiku role's name in older releases
        "CLAUDE_CODE_SUBAGENT_MODEL",
    )
    return {
        "ANTHROPIC_BASE_URL": setup.url,
        "ANTHROPIC_AUTH_TOKEN": setup.key,  # sent as a bearer token
        "ANTHROPIC_API_KEY": "",  # else a real key would be sent instead
        **dict.fromkeys(roles, setup.model),
        # Compaction is planned against this window instead of the 200K of Claude's own models.
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(setup.context),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(setup.output),
        # Both change the prompt on every turn, so no prefix of it could be reused from the cache. Named in
        # Claude Code's binary and by those who run it on other servers, not in its documentation.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
        "API_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(STREAM_IDLE_MS),  # its stream watchdog (undocumented, see above)
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry or update checks: it works offline
    }


def _claude_saved(setup: Setup) -> list[ConfigFile]:
    # settings.json's "env" holds variables for every session: the bare `claude` then uses localllm.
    return [json_merged(_claude_settings(), lambda old: merge(old, {"env": _claude_env(setup)}))]


# ---------------------------------------------------------------------------------------------------------- codex

CODEX_PROFILE = "localllm"


def _codex_profile() -> Path:
    # Codex 0.134 and later read a profile from its own file, $CODEX_HOME/NAME.config.toml, chosen with --profile.
    return _folder("CODEX_HOME", _home() / ".codex") / f"{CODEX_PROFILE}.config.toml"


def _codex_files(setup: Setup) -> list[ConfigFile]:
    model = json.dumps(setup.model)
    lines = [
        "# Written by `localllm launch codex`; `localllm launch codex --restore` removes it.",
        f"model = {model}",
        f"review_model = {model}",
        f'model_provider = "{CODEX_PROFILE}"',
        f"model_context_window = {setup.context}",
        f"model_auto_compact_token_limit = {setup.context - setup.output}",
        "",
        f"[model_providers.{CODEX_PROFILE}]",
        'name = "localllm"',
        f"base_url = {json.dumps(setup.api)}",
        'wire_api = "responses"',
        f"stream_idle_timeout_ms = {STREAM_IDLE_MS}",
    ]
    if setup.keyed:
        lines.append(f'env_key = "{KEY_VARIABLE}"')  # the key stays in the environment, not in the file
    return [whole(_codex_profile(), "\n".join(lines) + "\n")]


# ---------------------------------------------------------------------------------------------------------- opencode


def _opencode_config() -> Path:
    return _folder("XDG_CONFIG_HOME", _home() / ".config") / "opencode" / "opencode.json"


def _opencode_settings(setup: Setup, key: str) -> dict:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "localllm",
        "options": {
            "baseURL": setup.api,
            "apiKey": key,
            "timeout": REQUEST_TIMEOUT_MS,
            "headerTimeout": STREAM_IDLE_MS,
            "chunkTimeout": STREAM_IDLE_MS,
        },
        "models": {
            setup.model: {
                "name": setup.model,
                "tool_call": True,
                "limit": {"context": setup.context, "output": setup.output},
            }
        },
    }
    chosen = f"localllm/{setup.model}"
    return {"provider": {"localllm": provider}, "model": chosen, "small_model": chosen}


def _opencode_env(setup: Setup) -> dict[str, str]:
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(_opencode_settings(setup, setup.key))}


def _opencode_saved(setup: Setup) -> list[ConfigFile]:
    key = "{env:" + KEY_VARIABLE + "}" if setup.keyed else setup.key  # opencode substitutes {env:NAME}
    return [json_merged(_opencode_config(), lambda old: merge(old, _opencode_settings(setup, key)))]


# ---------------------------------------------------------------------------------------------------------- qwen

QWEN_KEY_VARIABLE = "LOCALLLM_AGENT_KEY"  # Qwen Code reads a provider's key only from a variable it is named


def _qwen_settings() -> Path:
    return _home() / ".qwen" / "settings.json"


def _qwen_memory(old: dict) -> dict:
    """Managed auto-memory off, unless the user's settings choose. After every turn it sends a request of its own,
    with another system prompt (so none of the turn's prefix is reused), that Qwen Code waits for before it exits; and
    its instructions make the main system prompt half as long again."""
    memory = old.get("memory")
    if isinstance(memory, dict) and "enableManagedAutoMemory" in memory:
        return {}
    return {"memory": {"enableManagedAutoMemory": False}}


def _qwen_files(setup: Setup) -> list[ConfigFile]:
    entry = {
        "id": setup.model,
        "name": f"{setup.model} (localllm)",
        "baseUrl": setup.api,
        "envKey": QWEN_KEY_VARIABLE,
        # timeout is documented with generationConfig; contextWindowSize is not in the pages read: unverified.
        "generationConfig": {"timeout": REQUEST_TIMEOUT_MS, "contextWindowSize": setup.context},
    }

    def update(old: dict) -> dict:
        found = old.get("modelProviders")
        providers: dict = found if isinstance(found, dict) else {}
        listed = providers.get("openai")
        others = [m for m in listed or [] if not (isinstance(m, dict) and m.get("id") == setup.model)]
        return merge(
            old,
            {
                "modelProviders": {**providers, "openai": [entry, *others]},
                "security": {"auth": {"selectedType": "openai"}},  # else it asks for /auth at start
                "model": {"name": setup.model},
                "env": {QWEN_KEY_VARIABLE: setup.key},  # its fallback when the variable is not set
                **_qwen_memory(old),
            },
        )

    return [json_merged(_qwen_settings(), update)]


# ---------------------------------------------------------------------------------------------------------- continue


def _continue_config() -> Path:
    return _home() / ".continue" / "localllm.yaml"  # beside the user's config.yaml, chosen with --config


def _continue_files(setup: Setup) -> list[ConfigFile]:
    model = {
        "name": f"{setup.model} (localllm)",
        "provider": "openai",
        "model": setup.model,
        "apiBase": setup.api,
        "apiKey": setup.key,
        "roles": ["chat", "edit", "apply", "summarize"],
        "capabilities": ["tool_use"],
        "defaultCompletionOptions": {"contextLength": setup.context, "maxTokens": setup.output},
        "requestOptions": {"timeout": REQUEST_TIMEOUT_MS // 1000},  # seconds
    }
    config = {"name": "localllm", "version": "1.0.0", "schema": "v1", "models": [model]}
    # JSON is YAML: no YAML writer needed.
    return [whole(_continue_config(), json.dumps(config, indent=2) + "\n")]


# ---------------------------------------------------------------------------------------------------------- aider


def _aider_paths() -> list[Path]:
    return [_home() / ".aider.localllm.model.settings.yml", _home() / ".aider.localllm.model.metadata.json"]


def _aider_name(setup: Setup) -> str:
    return f"ollama_chat/{setup.model}"  # aider's recommended route to an Ollama server (litellm's ollama_chat)


def _aider_files(setup: Setup) -> list[ConfigFile]:
    settings_path, metadata_path = _aider_paths()
    name = _aider_name(setup)
    # A fixed num_ctx: aider otherwise sizes it to each request, and the server would reload for every larger one.
    settings = [{"name": name, "extra_params": {"num_ctx": setup.context}}]
    limits = {"max_input_tokens": setup.context, "max_output_tokens": setup.output, "max_tokens": setup.output}
    free = {"input_cost_per_token": 0, "output_cost_per_token": 0}
    metadata = {name: {**limits, **free, "litellm_provider": "ollama_chat", "mode": "chat"}}
    return [
        whole(settings_path, json.dumps(settings, indent=2) + "\n"),
        whole(metadata_path, json.dumps(metadata, indent=2) + "\n"),
    ]


def _aider_env(setup: Setup) -> dict[str, str]:
    env = {"OLLAMA_API_BASE": setup.url}
    if setup.keyed:
        env["OLLAMA_API_KEY"] = setup.key
    return env


def _aider_args(setup: Setup) -> list[str]:
    settings_path, metadata_path = _aider_paths()
    return [
        "--model",
        _aider_name(setup),
        "--model-settings-file",
        str(settings_path),
        "--model-metadata-file",
        str(metadata_path),
        "--timeout",
        str(REQUEST_TIMEOUT_MS // 1000),
    ]


AGENTS: dict[str, Agent] = {
    "claude": Agent(
        "claude",
        "Claude Code",
        "npm install -g @anthropic-ai/claude-code",
        least=20_480,  # its first request, with its 24 tools, is about 18.8K tokens
        env=_claude_env,
        args=lambda setup: ["--model", setup.model],
        paths=lambda: [_claude_settings()],
        saved=_claude_saved,
    ),
    "codex": Agent(
        "codex",
        "Codex",
        "npm install -g @openai/codex",
        least=8_192,  # its first request is about 6K tokens
        env=lambda setup: {},
        args=lambda setup: ["--profile", CODEX_PROFILE],
        paths=lambda: [_codex_profile()],
        files=_codex_files,
    ),
    "opencode": Agent(
        "opencode",
        "opencode",
        "npm install -g opencode-ai",
        least=16_384,  # not measured: its prompt and tools are near Claude Code's in size
        env=_opencode_env,
        args=lambda setup: [],
        paths=lambda: [_opencode_config()],
        saved=_opencode_saved,
    ),
    "qwen": Agent(
        "qwen",
        "Qwen Code",
        "npm install -g @qwen-code/qwen-code",
        least=16_384,  # not measured
        env=lambda setup: {QWEN_KEY_VARIABLE: setup.key},
        args=lambda setup: [],
        paths=lambda: [_qwen_settings()],
        files=_qwen_files,
    ),
    "continue": Agent(
        "cn",
        "Continue CLI",
        "npm install -g @continuedev/cli",
        least=8_192,  # not measured
        env=lambda setup: {},
        args=lambda setup: ["--config", str(_continue_config())],
        paths=lambda: [_continue_config()],
        files=_continue_files,
    ),
    "aider": Agent(
        "aider",
        "aider",
        "python -m pip install aider-install && aider-install",
        least=4_096,  # a repository map and the chat, sized by aider itself
        env=_aider_env,
        args=_aider_args,
        paths=_aider_paths,
        files=_aider_files,
        start_env=lambda setup: {
            **_aider_env(setup),
            **({"OLLAMA_API_KEY": "$" + KEY_VARIABLE} if setup.keyed else {}),
        },
    ),
}

# Asked for, but configured only through its own settings screen or account: no file launch could write.
BY_HAND = {
    "cline": "Cline keeps its provider in its settings: choose 'OpenAI Compatible', base URL {url}/v1, any API key, "
    "the model's name, and its context window (`localllm launch claude --config` prints the one launch picks)",
}
