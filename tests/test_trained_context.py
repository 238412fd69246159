"""At the defaults a request may use the context its model was trained for (issue 47): qwen2.5-coder:0.5b, trained
for 32K tokens, serves a 14K-token prompt with no setting changed, as llama-server does; only a prompt over what the
model holds is refused. Through the real LocalClient, on the real engine."""

from __future__ import annotations

import pytest
from server_harness import local_client

from localllm import api
from localllm.errors import ContextOverflow

MODEL = "qwen2.5-coder:0.5b"
TRAINED = 32768  # qwen2.5-coder's context_length in its GGUF metadata

pytestmark = pytest.mark.models


@pytest.fixture
def defaults(monkeypatch):
    for name in ("LOCALLLM_CONTEXT_LENGTH", "LOCALLLM_NUM_PARALLEL", "LOCALLLM_KV_POOL", "LOCALLLM_NUM_THREAD"):
        monkeypatch.delenv(name, raising=False)


def numbered_lines(n: int) -> str:
    """Text no prefix cache has seen, about 18 tokens a line (digits are tokens of their own)."""
    return "".join(f"line {i}: the ledger entry {i * 7919 % 100_003} was checked\n" for i in range(n))


def test_the_plan_at_the_defaults_is_the_trained_context(coder_home, defaults):
    client = local_client(coder_home)
    try:
        (row,) = client.plan(api.PlanRequest(model=MODEL)).models
    finally:
        client.close()
    assert row.num_ctx == TRAINED and row.kv_cells == TRAINED  # one pool, any slot may use what others leave
    assert row.num_parallel > 1


@pytest.mark.slow
@pytest.mark.timeout(1800)  # its prefill takes minutes on two cores, more while other work shares them
def test_a_14k_token_prompt_is_served_at_the_defaults(coder_home, defaults):
    client = local_client(coder_home)
    try:
        (row,) = client.plan(api.PlanRequest(model=MODEL)).models
        if row.num_ctx < 16384:
            pytest.skip(f"this machine's memory holds a default context of {row.num_ctx} for {MODEL}")
        prompt = numbered_lines(800) + "Which line mentions ledger entry 7919?"
        request = api.GenerateRequest(model=MODEL, prompt=prompt, options={"num_predict": 2, "temperature": 0})
        (done,) = [chunk for chunk in client.generate(request) if chunk.done]
        assert 14_000 <= done.prompt_eval_count < TRAINED and done.eval_count >= 1
        (loaded,) = client.ps().models
        assert loaded.context_length == row.num_ctx

        # Over what the model was trained for: the clear 400, before any prefill.
        over = api.GenerateRequest(model=MODEL, prompt=numbered_lines(2000), options={"num_predict": 1})
        with pytest.raises(ContextOverflow, match=f"the context holds {row.num_ctx}"):
            list(client.generate(over))
    finally:
        client.close()


def _default_num_ctx(home, monkeypatch, memory: int | None) -> int:
    from localllm.models import options
    from localllm.models.options import load_options, resolve_options
    from localllm.models.store import Store

    monkeypatch.setattr(options, "total_memory", lambda: memory)
    resolved = Store(home / "models").resolve(MODEL)
    load, _ = resolve_options(resolved, None)
    n_ctx = load_options(resolved, load).num_ctx
    assert n_ctx is not None
    return n_ctx


GIB = 2**30


@pytest.mark.parametrize(
    ("memory", "n_ctx"), [(64 * GIB, TRAINED), (2 * GIB, 16384), (GIB // 4, 4096), (None, TRAINED)]
)
def test_the_default_context_is_what_a_quarter_of_the_memory_holds(coder_home, defaults, monkeypatch, memory, n_ctx):
    # qwen2.5-coder:0.5b: 12 KiB of KV a token (384 MiB at 32K) beside a compute buffer of about 300 MiB; below
    # 4,096 a default is not lowered (check_memory says what to do), and where the memory is unknown the trained one.
    assert _default_num_ctx(coder_home, monkeypatch, memory) == n_ctx


def test_a_context_length_setting_is_the_default_still(coder_home, defaults, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", "2048")
    assert _default_num_ctx(coder_home, monkeypatch, 64 * GIB) == 2048
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", "65536")  # a default over the trained context is clamped to it
    assert _default_num_ctx(coder_home, monkeypatch, 64 * GIB) == TRAINED
