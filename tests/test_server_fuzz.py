"""A bounded fuzz of the REST surface: a few hundred malformed bodies across every route the app serves (bad JSON,
wrong types, huge and negative numbers, nulls, deep nesting, long strings within the body limit, extreme options),
against the real server and model. No answer may be a 5xx, nothing may crash or hang, and a plain request works after.

The bodies come from a fixed seed, so a failure names a body that fails again."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import env, local_client, private_home, serve_in_thread

from localllm import api
from localllm.server.app import create_app

pytestmark = [pytest.mark.models, pytest.mark.slow]

MODEL = "smollm2:135m"
SEED = 13
CASES_PER_ROUTE = 20
TINY = {"num_predict": 2, "temperature": 0}

# A valid body per route, so that mutations reach deep into the handlers rather than stopping at the first field.
VALID: dict[str, dict[str, Any]] = {
    "/api/show": {"model": MODEL},
    "/api/copy": {"source": MODEL, "destination": "fuzz-copy"},
    "/api/delete": {"model": "fuzz-copy"},
    "/api/pull": {"model": "fuzz/absent:1", "stream": False},
    "/api/create": {"model": "fuzz-made", "from": MODEL, "system": "Be brief.", "stream": False},
    "/api/generate": {"model": MODEL, "prompt": "Hi", "stream": False, "options": TINY},
    "/api/chat": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": False, "options": TINY},
    "/api/embed": {"model": MODEL, "input": ["Hi"]},
    "/api/embeddings": {"model": MODEL, "prompt": "Hi"},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/embeddings": {"model": MODEL, "input": "Hi"},
}
# Names a mutation must never turn into the real model on a destructive route.
DESTRUCTIVE = {"/api/delete", "/api/copy"}

EXTREMES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**31,
    -(2**31) - 1,
    2**63,
    10**30,
    -(10**30),
    1e308,
    -1e308,
    0.5,
    "",
    "x" * 200_000,
    "\u0000",
    "../../etc/passwd",
    "smollm2:135m\u0000",
    "🙂" * 1000,
    [],
    {},
    [None],
    [[[[[]]]]],
    {"a": {"b": {}}},
    ["x"] * 5000,
    list(range(-5, 5)),
    {"role": "robot"},
]
OPTION_NAMES = sorted(api.LOAD_OPTION_NAMES | api.SAMPLING_OPTION_NAMES)
RAW_BODIES: list[bytes] = [
    b"",
    b"{",
    b"[",
    b"null",
    b"123",
    b'"text"',
    b'{"model": }',
    b"\xff\xfe\x00",
    b"{" * 100_000,
    b"[" * 50_000 + b"]" * 50_000,
    b'{"model": "smollm2:135m", "options": {"num_ctx": 1e999}}',
    b'{"model": "smollm2:135m", "prompt": "Hi", "keep_alive": NaN}',
    b'{"model": 1e999999}',
    b'{"model": "smollm2:135m", "options": {"top_k": 99999999999999999999999999999999}}',
]


def deep(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"k": [value]}
    return value


def mutations(path: str, rng: random.Random) -> Iterator[Any]:
    """Bodies for one route: the valid one with a field replaced, removed, or options pushed to extremes."""
    base = VALID.get(path, {"model": MODEL})
    for _ in range(CASES_PER_ROUTE):
        body = json.loads(json.dumps(base))
        choice = rng.random()
        if choice < 0.45 and body:
            body[rng.choice(sorted(body))] = rng.choice(EXTREMES)
        elif choice < 0.6 and body:
            del body[rng.choice(sorted(body))]
        elif choice < 0.9:
            body["options"] = {rng.choice(OPTION_NAMES): rng.choice(EXTREMES) for _ in range(rng.randint(1, 3))}
        else:
            body[rng.choice(sorted(body) or ["model"])] = deep(rng.choice([50, 400]))
        if path in DESTRUCTIVE:
            for key in ("model", "source", "destination"):
                if isinstance(body.get(key), str) and body[key].startswith("smollm2"):
                    body[key] = "fuzz-" + key
        yield body


def json_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route that takes a body, read from the app's OpenAPI schema so that new routes are
    fuzzed too."""
    return [
        (method.upper(), path)
        for path, methods in app.openapi()["paths"].items()
        if "{" not in path
        for method in sorted(methods)
        if method in ("post", "put", "delete")
    ]


@pytest.fixture(scope="module")
def served(models_home, tmp_path_factory):
    home = private_home(models_home, tmp_path_factory.mktemp("fuzz"))
    # A short context bounds every generation a mutation makes valid; offline keeps pull off the network.
    with env(LOCALLLM_CONTEXT_LENGTH="64", LOCALLLM_NUM_PARALLEL="1", LOCALLLM_HOME=str(home), LOCALLLM_OFFLINE="1"):
        client = local_client(home)
        app = create_app(client)
        try:
            with serve_in_thread(app) as url:
                yield url, app
        finally:
            client.close()


def test_malformed_bodies_on_every_route_never_get_a_server_error(served):
    url, app = served
    rng = random.Random(SEED)
    routes = json_routes(app)
    assert ("POST", "/api/generate") in routes and ("DELETE", "/api/delete") in routes
    failures = []
    sent = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        for method, path in routes:
            bodies = [json.dumps(b).encode() for b in mutations(path, rng)]
            for raw in bodies + rng.sample(RAW_BODIES, 4):
                if path in DESTRUCTIVE:
                    raw = raw.replace(MODEL.encode(), b"fuzz-raw:1")
                response = http.request(method, path, content=raw, headers={"content-type": "application/json"})
                sent += 1
                if response.status_code >= 500:
                    failures.append(f"{method} {path} {raw[:160]!r} -> {response.status_code} {response.text[:200]}")
        for path in (
            "/",
            "/health",
            "/metrics",
            "/api/version",
            "/api/tags",
            "/api/ps",
            "/v1/models",
            "/v1/models/" + "x" * 5000,
            "/v1/models/%00",
        ):
            response = http.get(path)
            sent += 1
            if response.status_code >= 500:
                failures.append(f"GET {path[:60]} -> {response.status_code} {response.text[:200]}")
        plain = http.post("/api/generate", json=VALID["/api/generate"])
    assert sent >= 200
    assert not failures, "\n".join(failures)
    assert plain.status_code == 200 and plain.json()["done"]
