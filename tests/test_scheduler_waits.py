"""A waiting request makes progress or ends: the scheduler walked on plain data over KV pools smaller than the
prefixes its cache has saved (the planted disk cache of issue 48: a state saved by a load with a longer context).
Each walk is bounded in steps, never in time: a request that cannot start within them would wait forever."""

from __future__ import annotations

import pytest

from localllm.backends.base import CacheShape
from localllm.engine.prefix_cache import PrefixCache
from localllm.engine.scheduler import Request, Scheduler, Step
from localllm.engine.slots import SlotState

SYSTEM = list(range(1, 21))  # the prompts' shared system prompt
STEPS = 200  # far above what any prompt here needs to start (a few chunks, a restore)


def _cache(*saved: list[int]) -> PrefixCache:
    cache = PrefixCache(CacheShape(fingerprint="toy"), ram_limit=10**9)
    for tokens in saved:
        assert cache.put(tokens, bytes(len(tokens))) is not None
    return cache


def _sched(cache: PrefixCache | None, *, slots: int, n_ctx: int, kv_cells: int | None) -> Scheduler:
    return Scheduler(n_slots=slots, n_ctx=n_ctx, n_batch=64, max_queue=8, prefix_cache=cache, kv_cells=kv_cells)


def _run(s: Scheduler, step: Step) -> None:
    """What the engine does with a step: restores succeed, and every request due a token gets one."""
    for restore in step.restores:
        s.restored(restore.request, ok=True)
    s.update(step, {work.request.id: [7] for work in step.work})


def _first_token(s: Scheduler, req: Request) -> tuple[int, list[Step]]:
    """Walk until `req` has its first token (or ended); the steps taken and the steps themselves."""
    steps = []
    for n in range(1, STEPS + 1):
        step = s.schedule()
        steps.append(step)
        _run(s, step)
        if req.generated or req.finished:
            return n, steps
    pytest.fail(f"request {req.id} had no token after {STEPS} steps: slot {req.slot}, waiting {len(s.waiting)}")


def _prompt(n: int, seed: int) -> list[int]:
    return SYSTEM + [100 + (seed * 13 + i) % 200 for i in range(n - len(SYSTEM))]


@pytest.mark.parametrize("slots", [1, 4])
def test_a_saved_state_longer_than_the_slots_context_is_passed_by(slots):
    # LOCALLLM_CONTEXT_LENGTH=256 over a cache written with 4,096 tokens per slot (the request).
    planted = _prompt(4096, seed=1)
    s = _sched(_cache(planted), slots=slots, n_ctx=256, kv_cells=256)
    req = Request(prompt=_prompt(30, seed=2), max_tokens=10, sink=None)
    s.admit(req)
    _, steps = _first_token(s, req)
    assert req.generated == [7] and not any(step.restores for step in steps)


def test_a_saved_state_and_a_prompt_that_never_fit_the_pool_together_prefill_instead():
    # Both fit a slot's context; the state loaded whole plus the prompt's rest never fits a pool of one context.
    saved = _prompt(200, seed=1)
    s = _sched(_cache(saved), slots=4, n_ctx=256, kv_cells=256)
    req = Request(prompt=_prompt(150, seed=2), max_tokens=10, sink=None)
    s.admit(req)
    _, steps = _first_token(s, req)
    assert req.generated == [7] and req.n_cached == 0 and not any(step.restores for step in steps)


def test_a_saved_state_that_fits_is_still_restored():
    saved = _prompt(120, seed=1)
    s = _sched(_cache(saved), slots=4, n_ctx=256, kv_cells=256)
    req = Request(prompt=saved + [5, 6, 7], max_tokens=10, sink=None)
    s.admit(req)
    _, steps = _first_token(s, req)
    assert any(step.restores for step in steps) and req.n_cached == len(saved)


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("kv_cells", [256, None])
@pytest.mark.parametrize("cached", ["none", "fits", "too long"])
def test_every_waiting_request_starts_over_pools_and_caches(slots, kv_cells, cached):
    saved = {"none": [], "fits": [_prompt(100, seed=3)], "too long": [_prompt(4096, seed=3), _prompt(250, seed=4)]}
    cache = _cache(*saved[cached]) if cached != "none" else None
    s = _sched(cache, slots=slots, n_ctx=256, kv_cells=kv_cells)
    requests = [Request(prompt=_prompt(40 + 50 * (i % 5), seed=i), max_tokens=3, sink=None) for i in range(8)]
    for req in requests:
        s.admit(req)
    for _ in range(STEPS):
        step = s.schedule()
        _run(s, step)
        for slot, req in s.table.serving():
            if slot.state is SlotState.DECODE and len(req.generated) >= req.max_tokens:
                s.finish(req, "length")
        if all(r.finished for r in requests):
            break
    assert [r.done_reason for r in requests] == ["length"] * len(requests)
    assert all(len(r.generated) == r.max_tokens for r in requests)
