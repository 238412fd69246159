"""The agents' config files, written so that `localllm launch AGENT --restore` puts back what was there.

The first time launch writes a file it keeps what was there beside it: `NAME.localllm-backup` holds the user's own
file, or an empty `NAME.localllm-created` marks that there was none. Later writes keep that first backup, so a restore
always returns to the file as it was before localllm touched it. JSON files are merged (the user's other keys stay);
files that only localllm reads are written whole."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidInput

BACKUP = ".localllm-backup"
CREATED = ".localllm-created"


@dataclass(frozen=True)
class ConfigFile:
    """One file an agent reads: `render` turns what the file holds now (None: no file) into what it should hold."""

    path: Path
    render: Callable[[str | None], str]


def whole(path: Path, text: str) -> ConfigFile:
    """A file only localllm writes: replaced whole."""
    return ConfigFile(path, lambda _old: text)


def json_merged(path: Path, update: Callable[[dict[str, Any]], dict[str, Any]]) -> ConfigFile:
    """A JSON file the user shares with localllm: parsed, changed by `update`, written back with the rest intact."""

    def render(old: str | None) -> str:
        settings = _parse_json(path, old) if old and old.strip() else {}
        return json.dumps(update(settings), indent=2) + "\n"

    return ConfigFile(path, render)


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`base` with `patch` laid over it, nested objects merged key by key (lists and values replaced)."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_json(path: Path, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(
            f"{path} is not plain JSON ({exc.msg} at line {exc.lineno}), so launch cannot add its settings to it",
            hint="remove its comments or trailing commas, or move the file away and run launch again",
        ) from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{path} holds a JSON {type(value).__name__}, not an object", hint="fix or move the file")
    return value


def write(files: list[ConfigFile]) -> list[Path]:
    """Write each file (its first backup kept, see the module's docstring); returns the paths written."""
    written = []
    for file in files:
        old = file.path.read_text() if file.path.is_file() else None
        new = file.render(old)
        _keep_first_backup(file.path, old)
        file.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = file.path.with_name(file.path.name + ".localllm-tmp")
        temporary.write_text(new)
        os.replace(temporary, file.path)  # a reader never sees half a file
        written.append(file.path)
    return written


def _keep_first_backup(path: Path, old: str | None) -> None:
    backup, created = _beside(path, BACKUP), _beside(path, CREATED)
    if backup.exists() or created.exists():
        return
    if old is None:
        created.parent.mkdir(parents=True, exist_ok=True)
        created.touch()
    else:
        shutil.copy2(path, backup)


def restore(paths: list[Path]) -> list[str]:
    """Put back each file as it was before launch wrote it; returns what was done, one line a file touched."""
    done = []
    for path in paths:
        backup, created = _beside(path, BACKUP), _beside(path, CREATED)
        if backup.exists():
            os.replace(backup, path)
            done.append(f"restored {path}")
        elif created.exists():
            path.unlink(missing_ok=True)
            created.unlink()
            done.append(f"removed {path} (launch had created it)")
    return done


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)
