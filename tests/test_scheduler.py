"""The scheduler is pure bookkeeping, so it is tested with data alone."""

from __future__ import annotations

import pytest

from localllm.engine.scheduler import Request, Scheduler
from localllm.engine.slots import SlotState, common_prefix
from localllm.errors import QueueFull


def _sched(slots=2, n_batch=8, n_ctx=64, max_queue=2) -> Scheduler:
    return Scheduler(n_slots=slots, n_ctx=n_ctx, n_batch=n_batch, max_queue=max_queue)


def _finish_prefill(s: Scheduler, req: Request, first_token: int = 100) -> None:
    """Run steps until req's prompt is prefilled, then feed its first sampled token."""
    while True:
        step = s.schedule()
        done = [w for w in step.work if w.request is req]
        s.update(step, {req.id: [first_token]} if done else {})
        if done:
            return


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def _prompt_beside_a_decoding_slot(s: Scheduler, prompt: list[int]):
    """(the decoding request, the new one, the first step that holds both)."""
    short = Request(prompt=[1, 2, 3], max_tokens=10, sink=None)
    s.admit(short)
    _finish_prefill(s, short)
    long = Request(prompt=prompt, max_tokens=10, sink=None)
    s.admit(long)
    return short, long, s.schedule()


def test_long_prompt_is_prefilled_in_chunks_beside_decoding_slots():
    short, _, step = _prompt_beside_a_decoding_slot(_sched(n_batch=8), list(range(10, 30)))
    # The decode row of the running request comes first; the long prompt fills the rest of the budget.
    assert step.batch.seqs[0] == short.slot.seq and step.batch.tokens[0] == 100
    assert len(step.batch) == 8
    assert step.batch.tokens[1:] == list(range(10, 17))
    assert [w.request for w in step.work] == [short]  # the chunk is not the last: nothing to sample for it


def test_prefill_chunks_end_on_the_backends_kv_grid_after_a_reused_prefix():
    # llama.cpp attends over whole spans of kv_pad cells: a chunk ending just past a multiple pays for an empty span.
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=2, kv_pad=256)
    first = Request(prompt=list(range(1000, 2563)), max_tokens=1, sink=None)
    s.admit(first)
    _finish_prefill(s, first)
    s.finish(first, "stop")
    # shares 7 tokens
    second = Request(prompt=list(range(1000, 1007)) + list(range(5000, 6556)), max_tokens=1, sink=None)
    s.admit(second)
    ends = []
    while second.slot is None or second.slot.state is SlotState.PREFILL:
        step = s.schedule()
        ends.append(step.batch.positions[-1] + 1)
        s.update(step, {second.id: [7]} if step.work else {})
    assert second.n_cached == 7
    assert ends == [512, 1024, 1536, 1563]  # not 519, 1031, 1543: the prompt's own end is where it ends

    # A chunk that would lose more than the span wastes keeps its length: beside a decode row, 511 tokens from 0.
    s = Scheduler(n_slots=2, n_ctx=4096, n_batch=512, max_queue=2, kv_pad=256)
    _, _, step = _prompt_beside_a_decoding_slot(s, list(range(10, 1010)))
    assert len(step.batch) == 512 and step.batch.positions[-1] == 510


def test_new_request_goes_to_the_slot_with_the_longest_shared_prefix():
    s = _sched(slots=2)
    a = Request(prompt=[1, 2, 3, 4], max_tokens=1, sink=None)
    b = Request(prompt=[7, 8, 9], max_tokens=1, sink=None)
    for r in (a, b):
        s.admit(r)
    step = s.schedule()
    s.update(step, {a.id: [5], b.id: [5]})
    slot_a = a.slot
    s.finish(a, "stop")
    s.finish(b, "stop")
    c = Request(prompt=[1, 2, 3, 4, 6], max_tokens=1, sink=None)
    s.admit(c)
    s.schedule()
    assert c.slot is slot_a and c.n_cached == 4


def test_prefix_is_copied_from_another_slot_that_shares_more():
    s = _sched(slots=2)
    system = list(range(1, 7))
    a = Request(prompt=system + [50], max_tokens=100, sink=None)
    s.admit(a)
    _finish_prefill(s, a)  # a keeps decoding in its slot
    b = Request(prompt=system + [60], max_tokens=1, sink=None)
    s.admit(b)
    step = s.schedule()
    assert step.copies == [(a.slot.seq, b.slot.seq, len(system))]
    assert b.n_cached == len(system)


def test_identical_prompt_still_decodes_its_last_token():
    s = _sched(slots=1)
    a = Request(prompt=[1, 2, 3], max_tokens=1, sink=None)
    s.admit(a)
    _finish_prefill(s, a)
    s.finish(a, "length")
    b = Request(prompt=[1, 2, 3], max_tokens=1, sink=None)
    s.admit(b)
    step = s.schedule()
    assert b.n_cached == 2 and step.batch.tokens == [3] and step.trims == [(b.slot.seq, 2)]


def test_queue_full_counts_free_slots():
    s = _sched(slots=1, max_queue=1)
    s.admit(Request(prompt=[1], max_tokens=1, sink=None))
    s.admit(Request(prompt=[2], max_tokens=1, sink=None))
    with pytest.raises(QueueFull):
        s.admit(Request(prompt=[3], max_tokens=1, sink=None))


def test_cancelled_request_frees_its_slot_at_the_next_step():
    s = _sched(slots=1)
    a = Request(prompt=[1, 2], max_tokens=50, sink=None)
    s.admit(a)
    _finish_prefill(s, a)
    waiting = Request(prompt=[9, 9], max_tokens=1, sink=None)
    s.admit(waiting)
    s.cancel(a)
    step = s.schedule()
    assert step.finished == [a] and a.done_reason == "cancelled"
    assert waiting.slot is not None and waiting.slot.state is SlotState.PREFILL


def test_drafts_ride_in_the_decode_rows_and_only_verified_ones_stay_cached():
    s = _sched(slots=1, n_batch=16)
    a = Request(prompt=[1, 2, 3], max_tokens=50, sink=None)
    s.admit(a)
    _finish_prefill(s, a, first_token=4)
    a.draft = [5, 6, 7]
    step = s.schedule()
    assert step.batch.tokens == [4, 5, 6, 7] and step.batch.positions == [3, 4, 5, 6]
    assert step.work[0].rows == [0, 1, 2, 3]
    s.update(step, {a.id: [5, 6, 9]})  # two drafts accepted, the third replaced by the target's token
    assert a.slot.cached == [1, 2, 3, 4, 5, 6]
    assert a.generated == [4, 5, 6, 9]


def test_drafts_never_reach_past_the_requests_num_predict():
    s = _sched(slots=1, n_batch=16)
    a = Request(prompt=[1, 2, 3], max_tokens=3, sink=None)
    s.admit(a)
    _finish_prefill(s, a, first_token=4)  # one of three tokens generated
    assert s.draft_room(a) == 1  # the decode row yields the second token; one draft could be the third
    a.draft = [5, 6, 7]
    step = s.schedule()
    assert step.batch.tokens == [4, 5] and a.draft == [5]


def test_decode_stops_at_the_context_edge():
    s = _sched(slots=1, n_ctx=6, n_batch=16)
    a = Request(prompt=[1, 2, 3, 4], max_tokens=50, sink=None)
    s.admit(a)
    _finish_prefill(s, a)
    a.draft = [7, 8, 9]
    step = s.schedule()
    # 4 cached prompt tokens: the decode row sits at position 4 and one draft fits the last cell, 5.
    assert step.batch.tokens == [100, 7] and step.batch.positions == [4, 5] and a.draft == [7]


def test_a_request_following_another_waits_for_its_prefill_then_copies_it():
    s = _sched(slots=3, n_batch=8)
    prompt = list(range(1, 21))  # three prefill steps at 8 tokens a step
    leader = Request(prompt=prompt, max_tokens=10, sink=None)
    follower = Request(prompt=list(prompt), max_tokens=10, sink=None, follows=leader)
    s.admit(leader)
    s.admit(follower)
    steps = []
    while leader.slot is None or leader.slot.state is not SlotState.DECODE:
        step = s.schedule()
        steps.append(step)
        done = [w for w in step.work if w.request is leader]
        s.update(step, {leader.id: [100]} if done else {})
        # While the leader prefills, the follower holds no slot and computes nothing.
        assert follower.slot is None
        assert all(seq == leader.slot.seq for seq in step.batch.seqs)
    assert sum(len(step.batch.tokens) for step in steps) == len(prompt)
    step = s.schedule()
    assert follower.slot is not None and follower.slot is not leader.slot
    assert step.copies == [(leader.slot.seq, follower.slot.seq, len(prompt) - 1)]
    assert follower.n_cached == len(prompt) - 1
    # Only the prompt's last token is left for the follower to decode: its output is its own first token.
    assert [t for t, seq in zip(step.batch.tokens, step.batch.seqs) if seq == follower.slot.seq] == [prompt[-1]]
