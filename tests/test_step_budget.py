"""The step budget (engine/step_budget.py) and the KV pool the slots share, on plain data: the scheduler is
bookkeeping, the cost model is numbers fed to it, so nothing here times anything."""

from __future__ import annotations

import pytest

from localllm.backends.base import CacheShape
from localllm.engine.prefix_cache import PrefixCache
from localllm.engine.scheduler import Request, Scheduler
from localllm.engine.slots import SlotState
from localllm.engine.step_budget import Line, StepBudget, StepCosts


class FixedCosts:
    """A StepCostModel with the costs given: what a test means by 'a step costs'."""

    def __init__(self, base: float, per_token: float):
        self.line = Line(base, per_token)

    def observe(self, tokens: int, seconds: float, *, chunk: bool) -> None:
        pass

    def fit(self) -> Line | None:
        return self.line


def _step_until_sampled(s: Scheduler, req: Request, token: int = 100) -> None:
    while True:
        step = s.schedule()
        done = any(w.request is req for w in step.work)
        s.update(step, {req.id: [token]} if done else {})
        if done:
            return


def _decoders(s: Scheduler, n: int, prompt_len: int = 3) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(prompt=[500 + i] * prompt_len, max_tokens=1000, sink=None)
        s.admit(req)
        _step_until_sampled(s, req)
        reqs.append(req)
    return reqs


# ---------------------------------------------------------------------------------------------------------- cost model


def test_the_learnt_cost_line_recovers_synthetic_step_times():
    costs = StepCosts()
    for tokens in (3, 3, 4, 512, 3, 256, 128, 3, 512, 64):
        costs.observe(tokens, 0.02 + 0.001 * tokens, chunk=tokens > 4)
    line = costs.fit()
    assert line is not None
    assert line.base == pytest.approx(0.02) and line.per_token == pytest.approx(0.001)


def test_the_line_with_the_larger_base_sizes_the_chunks():
    # Chunks deeper in a prompt cost more a token (attention): their own line reads no base, where the decode
    # steps' line still shows the step's fixed cost.
    costs = StepCosts()
    for i, tokens in enumerate((64, 128, 256, 512) * 4):
        costs.observe(3, 0.01, chunk=False)
        costs.observe(tokens, 0.0001 * tokens * (1 + i / 8), chunk=True)
    line = costs.fit()
    assert line is not None and line.base > 0.005


def test_the_chunks_line_wins_once_they_span_sizes():
    # Decode-only steps run under the chunks' line (llama.cpp's matrix-vector path): a line through both would read
    # the chunks' base as about nothing.
    costs = StepCosts()
    for _ in range(8):
        costs.observe(3, 0.05, chunk=False)
        costs.observe(512, 0.14 + 0.011 * 512, chunk=True)
    mixed = costs.fit()
    assert mixed is not None and mixed.base < 0.05  # only 512-token chunks so far: every step counts
    for tokens in (64, 70, 130, 200):
        costs.observe(tokens, 0.14 + 0.011 * tokens, chunk=True)
    line = costs.fit()
    assert line is not None
    assert line.base == pytest.approx(0.14) and line.per_token == pytest.approx(0.011)
    # By the chunks' line the prompt goes in steps more than twice as long (207 tokens against 84).
    sized_by_both = StepBudget(FixedCosts(mixed.base, mixed.per_token), slowdown=0.05).prefill_tokens(3, 509)
    assert StepBudget(costs, slowdown=0.05).prefill_tokens(3, 509) > 2 * sized_by_both


def test_no_line_until_the_samples_span_step_sizes():
    costs = StepCosts()
    for _ in range(20):  # decode-only steps: no slope to read
        costs.observe(3, 0.02, chunk=False)
    assert costs.fit() is None
    costs.observe(0, 1.0, chunk=True)  # empty or unmeasured steps are ignored
    costs.observe(64, 0.0, chunk=True)
    assert costs.fit() is None


def test_the_line_follows_the_latest_steps():
    costs = StepCosts(per_size=8)
    for tokens in (4, 400) * 8:
        costs.observe(tokens, 0.01 + 0.001 * tokens, chunk=tokens > 4)
    for tokens in (4, 400) * 8:  # the machine got four times slower
        costs.observe(tokens, 0.04 + 0.004 * tokens, chunk=tokens > 4)
    line = costs.fit()
    assert line is not None and line.per_token == pytest.approx(0.004)


def test_long_steps_are_remembered_through_many_decode_steps():
    costs = StepCosts()
    for tokens in (3, 512) * 8:
        costs.observe(tokens, 0.02 + 0.001 * tokens, chunk=tokens > 3)
    for _ in range(1000):  # the decoders ran alone for a long while
        costs.observe(3, 0.023, chunk=False)
    line = costs.fit()
    assert line is not None and line.per_token == pytest.approx(0.001)


def test_a_noisy_slope_gives_no_budget():
    costs = StepCosts()
    for tokens in (4, 400) * 5:  # bigger steps cheaper: load noise, not a cost
        costs.observe(tokens, 0.5 if tokens == 4 else 0.1, chunk=tokens > 4)
    assert costs.fit() is None
    assert StepBudget(costs).prefill_tokens(3, 509) == 509


# ---------------------------------------------------------------------------------------------------------- budget


def test_a_lone_prefill_uses_the_whole_step():
    budget = StepBudget(FixedCosts(base=0.02, per_token=0.01))
    assert budget.prefill_tokens(0, 512) == 512


def _per_prompt_token(line: Line, decode_rows: int, tokens: int) -> float:
    """What each prompt token costs in a step of `decode_rows` decode rows and `tokens` prompt tokens."""
    return line.seconds(decode_rows + tokens) / tokens


@pytest.mark.parametrize(
    ("base", "per_token", "decode_rows"),
    [(0.02, 0.004, 3), (0.14, 0.011, 3), (0.002, 0.00006, 3), (0.0, 0.014, 3), (0.14, 0.011, 16), (0.02, 0.004, 1)],
)
def test_the_prompt_pays_at_most_the_slowdown_for_the_pacing(base, per_token, decode_rows):
    budget = StepBudget(FixedCosts(base, per_token))
    line, full = Line(base, per_token), 512
    room = full - decode_rows
    n = budget.prefill_tokens(decode_rows, room)
    alone = _per_prompt_token(line, 0, full)
    assert budget.min_chunk <= n <= room
    if n < room:  # the fewest tokens within the bound: one fewer would cost the prompt more
        assert _per_prompt_token(line, decode_rows, n) <= (1 + budget.slowdown) * alone
        assert _per_prompt_token(line, decode_rows, n - 1) > (1 + budget.slowdown) * alone


def test_the_prefill_share_follows_the_budget():
    slow = StepBudget(FixedCosts(base=0.02, per_token=0.004), slowdown=0.1)
    # Three decode rows and the fixed part cost 0.032 s; the prompt may pay a tenth more a token than in 512-token
    # chunks (0.00404 s): 0.032 / (1.1 x 0.00404 - 0.004) is 72.2, so 73 tokens.
    assert slow.prefill_tokens(3, 509) == 73
    faster = StepBudget(FixedCosts(base=0.02, per_token=0.001), slowdown=0.1)
    assert faster.prefill_tokens(3, 509) > slow.prefill_tokens(3, 509)
    # More decoders, a dearer fixed part: more prefill per step, never past the batch's room.
    assert slow.prefill_tokens(8, 504) > slow.prefill_tokens(3, 509)
    assert StepBudget(FixedCosts(base=1.0, per_token=1e-6)).prefill_tokens(3, 509) > 480  # the step is its base
    # A tighter bound on the prompt's slowdown means longer steps.
    assert StepBudget(FixedCosts(0.02, 0.004), slowdown=0.05).prefill_tokens(3, 509) > 73


def test_a_prefill_always_advances():
    # A prompt allowed to pay ten times its lone cost needs few tokens a step: the chunk is the minimum.
    budget = StepBudget(FixedCosts(base=0.0001, per_token=1.0), slowdown=9.0, min_chunk=16)
    assert budget.prefill_tokens(3, 509) == 16
    assert budget.prefill_tokens(3, 5) == 5


def test_without_timings_the_step_is_sized_in_tokens():
    assert StepBudget().prefill_tokens(3, 509) == 509


def test_the_scheduler_schedules_every_decode_row_then_the_budgets_prefill():
    budget = StepBudget(FixedCosts(base=0.02, per_token=0.004), slowdown=0.1)
    s = Scheduler(n_slots=4, n_ctx=4096, n_batch=512, max_queue=4, pacing=budget)
    decoders = _decoders(s, 3)
    long = Request(prompt=list(range(1000, 2400)), max_tokens=4, sink=None)
    s.admit(long)
    step = s.schedule()
    rows = [w.request for w in step.work]
    assert all(d in rows for d in decoders)  # every decode row, first
    assert step.batch.tokens[:3] == [100, 100, 100]
    assert len(step.batch) == 3 + budget.prefill_tokens(3, 509) == 76
    s.update(step, {d.id: [101] for d in decoders})
    # Chunks go on at that size while the decoders run; every step still carries all three decode rows.
    chunks = [73]
    while long.slot is not None and long.slot.state is SlotState.PREFILL:
        step = s.schedule()
        decode_rows = sum(1 for seq in step.batch.seqs if seq != long.slot.seq)
        assert decode_rows == 3
        chunks.append(len(step.batch) - decode_rows)
        done = any(w.request is long for w in step.work)
        s.update(step, {**{d.id: [101] for d in decoders}, **({long.id: [7]} if done else {})})
    assert sum(chunks) == 1400 and max(chunks) <= 73 and len(chunks) > 1400 // 509


def test_a_lone_long_prompt_is_read_in_full_batches():
    s = Scheduler(n_slots=4, n_ctx=4096, n_batch=512, max_queue=4, pacing=StepBudget(FixedCosts(0.02, 0.004)))
    long = Request(prompt=list(range(1000, 2400)), max_tokens=4, sink=None)
    s.admit(long)
    assert len(s.schedule().batch) == 512


# ---------------------------------------------------------------------------------------------------------- KV pool


SHAPE = CacheShape(fingerprint="test build; slots 3; ctx 64")


def _pooled(
    cells: int, *, slots: int = 3, n_ctx: int = 64, n_batch: int = 64, cache: PrefixCache | None = None
) -> Scheduler:
    return Scheduler(n_slots=slots, n_ctx=n_ctx, n_batch=n_batch, max_queue=8, kv_cells=cells, prefix_cache=cache)


def test_a_long_conversation_uses_what_short_ones_leave():
    s = _pooled(64)  # three slots of 64 tokens drawing from 64 cells
    short = Request(prompt=[1] * 4, max_tokens=1, sink=None)
    s.admit(short)
    _step_until_sampled(s, short)
    s.finish(short, "length")
    long = Request(prompt=list(range(100, 150)), max_tokens=100, sink=None)
    s.admit(long)
    _step_until_sampled(s, long)
    assert long.slot is not None and s.cells_held() == 50 + 4  # no prefix cache: the idle short cache stays
    # It decodes past the short one's cells: the idle cache is given up.
    for _ in range(12):
        step = s.schedule()
        s.update(step, {long.id: [7]})
    assert len(long.slot.cached) == 62 and s.cells_held() == 62
    assert short.slot.cached == []


def test_a_request_starting_in_a_shared_pool_gives_up_the_idle_caches():
    # llama.cpp attends over every cell up to the highest one used, idle caches' too (smollm2 decoded 0.94x as fast
    # beside the idle caches 16 clients left): as llama-server's --cache-idle-slots, they go when a request starts.
    s = _pooled(128, cache=PrefixCache(SHAPE, ram_limit=10**7))
    first, second = (Request(prompt=p, max_tokens=1, sink=None) for p in ([1, 2, 3, 4], [5, 6, 7]))
    s.admit(first)
    _step_until_sampled(s, first)
    s.finish(first, "length")
    assert s.cells_held() == 4  # idle, until a request starts
    s.admit(second)
    step = s.schedule()
    assert step.trims == [(first.slot.seq, 0)] and s.cells_held() == 0 and len(step.batch) == 3
    # A request that continues a conversation keeps its own slot's cache.
    s.update(step, {second.id: [8]})
    s.finish(second, "length")
    third = Request(prompt=[5, 6, 7, 8, 9], max_tokens=1, sink=None)
    s.admit(third)
    step = s.schedule()
    assert third.slot is second.slot and third.n_cached == 3 and step.batch.tokens == [8, 9]


def test_requests_arriving_together_each_find_their_own_cache_first():
    s = _pooled(128, cache=PrefixCache(SHAPE, ram_limit=10**7))
    a, b = (Request(prompt=p, max_tokens=1, sink=None) for p in ([1, 2, 3, 4], [5, 6, 7]))
    for req in (a, b):  # two conversations at once: neither cache is idle when the other starts
        s.admit(req)
    step = s.schedule()
    s.update(step, {a.id: [8], b.id: [9]})
    s.finish(a, "length")
    s.finish(b, "length")
    a2, b2 = (Request(prompt=p, max_tokens=1, sink=None) for p in ([1, 2, 3, 4, 8, 10], [5, 6, 7, 9, 11]))
    s.admit(a2)
    s.admit(b2)
    step = s.schedule()
    assert (a2.slot, b2.slot) == (a.slot, b.slot) and (a2.n_cached, b2.n_cached) == (4, 3) and not step.trims


def _two_ended(s: Scheduler, older_prompt: list[int], latest_prompt: list[int]) -> tuple[Request, Request]:
    """Two conversations run together and end, the latest a step after the older: two idle caches."""
    older, latest = (Request(prompt=p, max_tokens=8, sink=None) for p in (older_prompt, latest_prompt))
    for req in (older, latest):
        s.admit(req)
    step = s.schedule()
    s.update(step, {older.id: [7], latest.id: [7]})
    s.finish(older, "length")
    s.update(s.schedule(), {latest.id: [8]})  # the latest decodes a step longer
    s.finish(latest, "length")
    return older, latest


def test_once_nothing_runs_the_older_idle_caches_are_saved_ahead():
    # After sixteen clients, saving the idle caches took 4-8 ms of the next request's first token: they are saved
    # while nothing runs, one a step, and stay in their slots; the latest is left for its conversation to continue.
    cache = PrefixCache(SHAPE, ram_limit=10**7)
    s = _pooled(128, n_batch=128, cache=cache)
    older, latest = _two_ended(s, list(range(100, 140)), list(range(200, 240)))
    assert not s.idle  # the older cache is due a save
    step = s.schedule()
    assert [(save.seq, len(save.tokens)) for save in step.saves] == [(older.slot.seq, 40)]
    assert not step.trims and not step.batch.tokens and s.cells_held() == 40 + 41
    for save in step.saves:  # as the engine's CacheKeeper does
        cache.put(save.tokens, b"state")
    assert s.idle and not s.schedule()  # the latest stays unsaved until a request starts
    # The next request gives both up: the older one with a trim alone, the latest saved first (a prompt's cells go
    # where the pool is free: given up in its first step, the idle caches leave it room below).
    s.admit(Request(prompt=list(range(300, 340)), max_tokens=1, sink=None))
    step = s.schedule()
    assert [save.seq for save in step.saves] == [latest.slot.seq]
    assert sorted(step.trims) == sorted([(older.slot.seq, 0), (latest.slot.seq, 0)])


def test_a_restore_takes_a_slot_that_needs_no_save_first():
    # After sixteen clients, a saved story went back into the latest client's slot, the one sharing the chat
    # template's start with it, and that cache was saved first: 2-3 ms of the story's first token. The restore
    # replaces its slot's cache whole, so it takes one the prefix cache already holds; the latest, which a save
    # must keep, goes once the first token is out (a restore's step is copies alone, its first token the next).
    cache = PrefixCache(SHAPE, ram_limit=10**7)
    story = [9] * 4 + list(range(500, 540))
    s = _pooled(100, slots=2, n_batch=128, cache=cache)
    older, latest = _two_ended(s, list(range(100, 140)), story[:4] + [7] * 36)
    cache.put(story, b"story state")  # saved by an earlier load, say
    step = s.schedule()  # nothing runs: the older cache is saved ahead
    assert [save.seq for save in step.saves] == [older.slot.seq]
    for save in step.saves:
        cache.put(save.tokens, b"state")
    again = Request(prompt=story + [1], max_tokens=2, sink=None)
    s.admit(again)
    step = s.schedule()
    assert [(r.seq, r.keep) for r in step.restores] == [(older.slot.seq, 44)] and not step.saves
    assert latest.slot.cached == latest.prompt + [7]  # neither saved nor given up in the restore's step
    s.restored(again, ok=True)  # as the engine's CacheKeeper does
    s.update(step, {})
    step = s.schedule()  # the prompt's last token: its first token comes from this step
    assert step.batch.tokens == [1] and not step.saves and latest.slot.cached == latest.prompt + [7]
    s.update(step, {again.id: [5]})
    step = s.schedule()  # it is out: the latest cache goes, saved first
    assert [save.seq for save in step.saves] == [latest.slot.seq] and step.trims == [(latest.slot.seq, 0)]


@pytest.mark.parametrize("cells, cache", [(3 * 64, True), (128, False)], ids=["no shared pool", "no prefix cache"])
def test_idle_caches_stay_without_a_shared_pool_or_a_prefix_cache(cells, cache):
    # As many cells as every slot's context: no pool to share. Without a prefix cache the cells would be lost, not
    # saved (llama-server keeps idle slots without its RAM cache too).
    s = _pooled(cells, cache=PrefixCache(SHAPE, ram_limit=10**7) if cache else None)
    first, second = (Request(prompt=p, max_tokens=1, sink=None) for p in ([1, 2, 3, 4], [5, 6, 7]))
    for req in (first, second):
        s.admit(req)
        _step_until_sampled(s, req)
        s.finish(req, "length")
    assert s.cells_held() == 7 and first.slot.cached == [1, 2, 3, 4]
    assert s.idle and not s.schedule()  # nor are they saved ahead: nothing would give them up


def test_a_request_that_does_not_fit_waits_and_nothing_exceeds_the_pool():
    s = _pooled(64)
    first = Request(prompt=list(range(100, 140)), max_tokens=100, sink=None)
    s.admit(first)
    _step_until_sampled(s, first)
    second = Request(prompt=list(range(200, 240)), max_tokens=4, sink=None)
    s.admit(second)
    step = s.schedule()
    assert second.slot is None and list(s.waiting) == [second]  # 40 + 40 cells do not fit 64: it waits
    for _ in range(30):  # whatever the steps do, the cells held plus the rows asked for stay within the pool
        assert s.cells_held() + len(step.batch) <= 64
        s.update(step, {r.id: [7] for r in s.running if any(w.request is r for w in step.work)})
        if first.finished:
            break
        step = s.schedule()
    assert first.finished and first.done_reason == "length"  # the pool was full: it ends as at a context's end
    s.finish(first, first.done_reason or "length")
    step = s.schedule()
    assert second.slot is not None  # the first one's cells are its now
    assert s.cells_held() + len(step.batch) <= 64


def test_a_prefill_admitted_is_never_starved_by_decoders():
    s = _pooled(64, n_batch=8)
    first = Request(prompt=list(range(100, 110)), max_tokens=100, sink=None)
    s.admit(first)
    _step_until_sampled(s, first)
    second = Request(prompt=list(range(200, 240)), max_tokens=4, sink=None)  # 10 + 40 + 2 fits 64
    s.admit(second)
    while True:
        step = s.schedule()
        assert s.cells_held() + len(step.batch) <= 64
        if any(w.request is second for w in step.work):
            break
        s.update(step, {first.id: [7]} if not first.finished else {})
    assert len(second.prompt) == second.n_prefilled  # its prompt was read whole, the decoder stopping first
    assert s.cells_held() + len(step.batch) <= 64


def test_a_pool_smaller_than_one_context_is_refused():
    with pytest.raises(ValueError, match="cannot hold one slot's context"):
        _pooled(32, n_ctx=64)


def test_a_pool_as_large_as_every_slot_bounds_nothing():
    s = _pooled(3 * 64)
    assert s.kv_cells is None


def test_a_deterministic_request_starts_from_an_empty_pool():
    # In a shared pool a sequence's cells land where others left room, which changes llama.cpp's sums: a
    # deterministic request has every idle cache given up first, so it lands on the same cells every time.
    s = _pooled(64)
    for prompt in ([1, 2, 3, 4], [5, 6, 7]):
        req = Request(prompt=prompt, max_tokens=1, sink=None)
        s.admit(req)
        _step_until_sampled(s, req)
        s.finish(req, "length")
    assert s.cells_held() == 7
    det = Request(prompt=[1, 2, 3, 4, 9], max_tokens=4, sink=None, deterministic=True)
    s.admit(det)
    step = s.schedule()
    assert sorted(step.trims) == [(0, 0), (1, 0)] and det.n_cached == 0
    assert s.cells_held() == 0 and len(step.batch) == 5


def test_without_a_pool_a_deterministic_request_leaves_the_other_caches():
    s = _pooled(3 * 64)  # every slot has cells of its own: others' caches cannot move its cells
    first = Request(prompt=[1, 2, 3, 4], max_tokens=1, sink=None)
    s.admit(first)
    _step_until_sampled(s, first)
    s.finish(first, "length")
    det = Request(prompt=[5, 6, 7], max_tokens=4, sink=None, deterministic=True)
    s.admit(det)
    step = s.schedule()
    assert step.trims == [] and s.cells_held() == 4
