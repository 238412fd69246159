"""Stored /v1/responses answers: one JSON file each under LOCALLLM_HOME/responses, kept for previous_response_id and
GET/DELETE. Bounded by count (LOCALLLM_RESPONSES_MAX) and age (LOCALLLM_RESPONSES_MAX_AGE): each save prunes the
oldest. Files are written whole (a temporary file renamed into place), so a crash leaves no half answer behind."""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from ... import api, config
from ...errors import InvalidInput, ResponseNotFound

_ID = re.compile(r"^resp_[0-9a-f]{16,64}$")


def _path(response_id: str) -> Path:
    if not _ID.match(response_id):
        raise InvalidInput(f"response id {response_id[:80]!r} is not valid", hint="ids look like resp_<hex>")
    return config.responses_dir() / f"{response_id}.json"


def save(stored: api.StoredResponse) -> None:
    path = _path(stored.response["id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(stored.model_dump_json(exclude_none=True))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    prune()


def load(response_id: str) -> api.StoredResponse:
    path = _path(response_id)
    try:
        return api.StoredResponse.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResponseNotFound(
            f"response {response_id!r} not found",
            hint="it was never stored (store: false), deleted, or pruned by age or count",
        ) from None


MAX_PAGE = 100


def input_items_page(
    stored: api.StoredResponse, *, limit: int = 20, order: str = "desc", after: str | None = None
) -> dict[str, Any]:
    """OpenAI's list of a response's input items: `limit` (1 to 100) of them in `order`, after the item `after`."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit {limit} is not valid", hint=f"use 1 to {MAX_PAGE}")
    if order not in ("asc", "desc"):
        raise InvalidInput(f"order {order[:20]!r} is not valid", hint="use asc or desc")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidInput(f"after {after[:80]!r} is not an input item of this response")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def delete(response_id: str) -> None:
    path = _path(response_id)
    try:
        path.unlink()
    except FileNotFoundError:
        raise ResponseNotFound(f"response {response_id!r} not found") from None


def prune(now: float | None = None) -> None:
    """Drop answers older than the age limit, then the oldest beyond the count limit."""
    folder = config.responses_dir()
    if not folder.is_dir():
        return
    now = time.time() if now is None else now
    max_age, max_count = config.RESPONSES_MAX_AGE.get(), config.RESPONSES_MAX.get()
    files = []
    for path in folder.glob("resp_*.json"):
        try:
            files.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # deleted meanwhile by another request
            continue
    files.sort(reverse=True)
    for index, (mtime, path) in enumerate(files):
        if index >= max_count or now - mtime > max_age:
            path.unlink(missing_ok=True)
