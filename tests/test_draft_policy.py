"""The draft policy on plain values: prompt lookup, the step cost fit and the draft window. No model and no native
code: these run without llama-cpp-python."""

from __future__ import annotations

import random

import numpy as np
import pytest

from localllm.engine.speculative.drafters import PromptLookup, draft_from, lookup_draft
from localllm.engine.speculative.policy import DepthCosts, DraftWindow, FixedWindow, StepCost, any_draft_pays

# ---------------------------------------------------------------------------------------------------------- lookup


def test_lookup_continues_latest_earlier_occurrence_of_longest_ending():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [2, 3] ends the list; its latest earlier occurrence is at 5..6, followed by 7, 8, 5 ...
    assert lookup_draft(tokens, 3) == ([7, 8, 5], 2)
    assert PromptLookup().lookup(tokens, 3) == ([7, 8, 5], 2)


def test_lookup_prefers_longer_match_over_later_shorter_one():
    tokens = [4, 1, 2, 3, 50, 51, 9, 2, 3, 60, 1, 2, 3]
    # [1, 2, 3] (n=3) occurred at 1..3 -> 50, 51; the later [2, 3] at 7..8 is only a 2-gram.
    assert PromptLookup().lookup(tokens, 2) == ([50, 51], 3)


def test_lookup_stops_at_the_end_of_the_list_and_reports_no_match():
    assert PromptLookup().lookup([1, 2, 3], 5) == ([], 0)
    assert PromptLookup().lookup([7, 7], 5) == ([7], 1)
    assert PromptLookup().lookup([], 4) == ([], 0)


def test_lookup_measures_the_whole_match_behind_the_ending():
    copied = list(range(10, 30))
    tokens = copied + [99] + copied[:12]  # a copy in progress: 12 tokens match, though the index keys hold 4
    assert PromptLookup().lookup(tokens, 3) == ([22, 23, 24], 12)


def test_incremental_index_matches_brute_force_on_random_lists():
    rng = random.Random(7)
    for _ in range(30):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 60))]
        index = PromptLookup()
        for end in range(1, len(tokens) + 1):  # the list grows by one token per step, as a generation does
            assert index.lookup(tokens[:end], 6) == lookup_draft(tokens[:end], 6), tokens[:end]


def test_index_restarts_when_given_a_shorter_list():
    index = PromptLookup()
    index.lookup([1, 2, 3, 1, 2], 4)
    assert index.lookup([5, 6, 5], 4) == ([6, 5], 1)


# ---------------------------------------------------------------------------------------------------------- window


def test_step_cost_recovers_a_linear_cost_from_decode_steps():
    cost = StepCost()
    rng = random.Random(1)
    for _ in range(400):
        rows = rng.choice([1, 1, 2, 5, 9, 17])
        cost.record(rows, rows, 0.010 + 0.005 * rows)
        cost.record(120, 1, 0.1)  # a prefill chunk: other kernels, no output layer; left out
    assert cost.seconds(1) == pytest.approx(0.015, rel=0.05)
    assert cost.seconds(17) == pytest.approx(0.095, rel=0.05)


def test_window_drafts_long_when_rows_are_cheap_and_drafts_are_right():
    window = DraftWindow(8, StepCost())
    assert window.cut([0.95] * 12, busy_slots=1) == 8


def test_window_stops_when_a_busy_batch_makes_rows_dear():
    cost = StepCost()
    for rows in (1, 2, 4, 8, 16) * 20:  # every row costs as much as a one-row step: a compute-bound machine
        cost.record(rows, rows, 0.010 * rows)
    window = DraftWindow(16, cost)
    assert window.cut([0.9] * 16, busy_slots=4) == 0
    assert window.cut([0.9] * 16, busy_slots=1) <= 1


def test_window_on_a_memory_bound_machine_drafts_with_one_slot_but_less_with_four():
    cost = StepCost()
    for rows in (1, 2, 4, 8, 16, 32) * 20:  # fixed cost dominates, each row adds a tenth of a step
        cost.record(rows, rows, 0.010 + 0.001 * rows)
    one, four = DraftWindow(16, cost), DraftWindow(16, cost)
    assert one.cut([0.9] * 16, busy_slots=1) > four.cut([0.9] * 16, busy_slots=4) >= 0
    assert one.cut([0.9] * 16, busy_slots=1) >= 4


def test_window_does_not_try_drafts_in_a_shared_batch_before_the_row_cost_is_measured():
    cost = StepCost()
    for _ in range(50):  # every step the same size: fixed and per-row cost cannot be told apart
        cost.record(4, 4, 0.040)
    assert not cost.identified
    window = DraftWindow(16, cost)
    assert window.cut([0.9] * 16, busy_slots=4) == 0  # trying would hold up the other three requests
    assert window.cut([0.995] * 16, busy_slots=4) == 0  # ... even a short copy of sure tokens: it may still miss
    assert window.cut([0.99] * 16, busy_slots=1) > 4  # alone, a trial costs only this request
    for rows in (1, 2, 3) * 6:  # requests come and go: smaller batches show what a row costs
        cost.record(rows, rows, 0.004 + 0.009 * rows)
    assert cost.identified
    assert cost.seconds(4) - cost.seconds(3) == pytest.approx(0.009, rel=0.3)
    assert window.cut([0.99] * 16, busy_slots=4) == 0  # measured: a row costs too much for four busy slots


def _attention_cost(rows: int, depth: int) -> float:
    """Seconds of a decode step on the measured 0.5B here: 11 ms of weights, and per row 8 ms plus its attention over
    `depth` cells (2.3 ms per 1K): 10 ms a row at 1K, 26 ms at 8K."""
    return 0.011 + rows * (0.008 + 0.0023 * depth / 1024)


def _learn(costs: DepthCosts, depth: int, steps: int = 60) -> None:
    for rows in (1, 1, 1, 4, 9) * (steps // 5):
        costs.record(rows, rows, _attention_cost(rows, depth), depth=depth)


def test_depth_bands_grow_by_a_root_of_two_from_1k():
    depths = (0, 1023, 1024, 1448, 1449, 2048, 4096, 4160, 8150, 8192, 16384)
    assert [DepthCosts.band(d) for d in depths] == [0, 0, 1, 1, 2, 3, 5, 5, 6, 7, 9]


def test_drafts_that_pay_at_1k_are_not_taken_at_8k_where_rows_cost_more():
    """The prompts section's loss: a cost learnt near the start of a conversation sized drafts deep in an 8K one,
    where each draft row reads eight times the cells, and speculation ran below decoding without it."""
    costs = DepthCosts()
    _learn(costs, 1000)
    _learn(costs, 8300)
    window = DraftWindow(16, costs)
    confidences = [0.75] * 16  # an n-gram match of two tokens, as in the section's code-like text
    costs.at(900)
    shallow = window.cut(confidences, busy_slots=1)
    costs.at(8400)
    deep = window.cut(confidences, busy_slots=1)
    assert shallow >= 1 and deep == 0
    assert DraftWindow(16, costs).cut([0.995] * 16, busy_slots=1) > 0  # a sure copy still pays deep in a context


def test_a_band_learns_only_from_steps_at_its_depth():
    costs = DepthCosts()
    _learn(costs, 500)
    assert costs.at(12000).measured is False  # nothing ran at that depth: it starts from the prior
    assert costs.at(600).seconds(9) == pytest.approx(_attention_cost(9, 500), rel=0.1)
    assert "<1K:" in costs.describe() and "11.3K-16K:" in costs.describe()


def test_a_new_deep_band_prices_its_rows_from_one_plain_step():
    """Crossing into a deeper band (an 8K prompt's answer passes 8,192 tokens) must not cost a trial of drafts: the
    fixed part measured shallower holds at any depth, so one plain step there tells what a row costs."""
    costs = DepthCosts()
    _learn(costs, 1000)
    costs.at(8400)
    assert costs.learnt_elsewhere()  # the engine takes no drafts this step
    costs.record(1, 1, _attention_cost(1, 8400), depth=8400)
    deep = costs.at(8400)
    assert not costs.learnt_elsewhere()
    assert deep.seconds(9) == pytest.approx(_attention_cost(9, 8400), rel=0.15)
    assert not DepthCosts().learnt_elsewhere()  # a model's first steps have nothing better: the prior as before


def test_drafts_that_yielded_less_than_plain_steps_rest_then_try_again():
    """Deep in an 8K context two rows cost 2.2 one-row steps here, so drafts accepted half the time lose, whatever
    the linear fit says: what the steps delivered decides."""
    cost = StepCost()
    for _ in range(10):
        cost.record_outcome(1, drafted=False, tokens=1, seconds=0.034)
    for _ in range(5):
        cost.record_outcome(1, drafted=True, tokens=2, seconds=0.076)
    assert cost.drafts_lose(1) and not cost.drafts_lose(4)  # another batch size has its own record
    rested = 0
    while cost.drafts_lose(1):
        cost.record_outcome(1, drafted=False, tokens=1, seconds=0.034)
        rested += 1
    assert rested == StepCost.REST_STEPS  # a while without drafts, then a new trial judged on its own steps
    cost.record_outcome(1, drafted=True, tokens=5, seconds=0.080)
    assert not cost.drafts_lose(1)
    winning = StepCost()
    for _ in range(10):
        winning.record_outcome(1, drafted=False, tokens=1, seconds=0.020)
        winning.record_outcome(1, drafted=True, tokens=5, seconds=0.060)
    assert not winning.drafts_lose(1)


def test_window_never_offers_more_than_the_room_left():
    window = DraftWindow(16, StepCost())
    run = window.start(busy_slots=1, room=2)
    assert run.offer(0.99) and run.offer(0.99) and not run.offer(0.99)
    assert FixedWindow(8, StepCost()).cut([0.5] * 3, busy_slots=1) == 3


def test_window_learns_acceptance_and_shrinks_after_rejections():
    cost = StepCost()
    for rows in (1, 2, 4, 8, 16) * 20:
        cost.record(rows, rows, 0.010 + 0.003 * rows)
    window = DraftWindow(16, cost)
    before = window.cut([0.9] * 16, busy_slots=1)
    for _ in range(10):
        window.cut([0.9] * 8, busy_slots=1)
        window.record(drafted=8, accepted=0)
    assert window.acceptance == 0.0
    assert window.cut([0.9] * 16, busy_slots=1) < before


def test_window_believes_each_confidence_band_separately():
    cost = StepCost()
    for rows in (1, 2, 4, 8, 16) * 20:
        cost.record(rows, rows, 0.010 + 0.003 * rows)
    window = DraftWindow(16, cost)
    for _ in range(20):  # long matches always right, short ones always wrong
        window.cut([0.97] * 8, busy_slots=1)
        window.record(drafted=8, accepted=8)
        window.cut([0.6] * 8, busy_slots=1)
        window.record(drafted=8, accepted=0)
    assert window.per_token(0.97) > 0.95 and window.per_token(0.6) < 0.3
    assert window.cut([0.97] * 16, busy_slots=1) == 16
    assert window.cut([0.6] * 16, busy_slots=1) == 0


def test_fixed_window_always_drafts_its_limit():
    window = FixedWindow(3, StepCost())
    assert window.cut([0.01] * 10, busy_slots=4) == 3


def test_a_step_that_cannot_speculate_asks_no_drafter():
    dear = StepCost()
    for rows in (1, 2, 3, 4) * 20:  # a row costs as much as a one-row step's fixed part (smollm2 on this CPU)
        dear.record(rows, rows, 0.009 + 0.009 * rows)
    assert not any_draft_pays(dear, 4)  # even a sure draft cannot beat the 20% margin of a batch of four
    assert any_draft_pays(dear, 1)
    cheap = StepCost()
    for rows in (1, 2, 3, 4) * 20:  # a fixed cost dominates: drafts may pay, even in a batch of four
        cheap.record(rows, rows, 0.030 + 0.001 * rows)
    assert any_draft_pays(cheap, 4)
    # Nothing measured yet: a lone request may try drafts (only it waits on them), a shared batch may not.
    assert any_draft_pays(StepCost(), 1) and not any_draft_pays(StepCost(), 4)
    assert FixedWindow.any_draft_pays(dear, 4)  # the fixed window drafts whatever it costs


def _bent_cost() -> StepCost:
    """The step costs of qwen2.5-coder:1.5b on a 2-core CPU: one-row steps 34 ms, each extra row ~13-19 ms, and a
    straight line through the wide draft steps that puts a one-row step near 42 ms."""
    cost = StepCost()
    for _ in range(5):
        for _ in range(40):
            cost.record(1, 1, 0.034)
        for _ in range(10):
            cost.record(4, 4, 0.034 + 3 * 0.019)
        cost.record(33, 33, 0.0216 + 0.0133 * 33)
    return cost


def test_a_step_is_compared_with_what_a_step_of_its_size_really_costs():
    cost = _bent_cost()
    assert cost.seconds(1) > 0.040  # the fit, right for wide steps, is off for a lone row
    assert cost.baseline(1) == pytest.approx(0.034)
    assert cost.with_drafts(1, 4) == pytest.approx(0.034 + 4 * cost.coef[1])
    # Sizes not seen: the nearest smaller mean and the slope speak for them where they say less than the fit.
    assert cost.baseline(2) == pytest.approx(0.034 + cost.coef[1]) and cost.baseline(2) < cost.seconds(2)
    assert cost.baseline(7) == pytest.approx(min(cost.seconds(7), cost.baseline(4) + 3 * cost.coef[1]))
    assert StepCost().baseline(3) == StepCost().seconds(3)  # nothing measured: the fit (its prior)


def test_a_draft_model_that_costs_more_than_the_rows_it_saves_stops_drafting():
    """The real pair on a CPU: a 0.5B draft token costs 20 ms, a verified row 13 ms, a plain step 34 ms, so even a
    draft the target always accepts is slower than no draft. The window must not draft; free drafts (n-gram) still
    pay."""
    cost = _bent_cost()
    window = DraftWindow(16, cost)
    for _ in range(20):  # the draft model is always right
        window.offered = [0.97] * 8
        window.record(drafted=8, accepted=8)
    model_run = window.start(busy_slots=1, draft_seconds=0.020)
    assert not model_run.promising()  # asked before the draft model decodes anything
    while model_run.offer(0.99):  # each next token pays a little, but the whole draft never does
        pass
    assert not model_run.worthwhile()
    free_run = window.start(busy_slots=1, draft_seconds=0.0)
    while free_run.offer(0.99):
        pass
    assert free_run.promising()
    assert free_run.position >= 4 and free_run.worthwhile()


def test_the_first_draft_is_a_short_trial_until_a_row_is_priced():
    window = DraftWindow(32, StepCost())
    run = window.start(busy_slots=1)
    while run.offer(0.999):
        pass
    assert run.position == DraftWindow.TRIAL  # a 32-token gamble of a 0.5B draft cost seconds on a 2-core CPU
    cheap = StepCost()
    for rows in (1, 2, 4, 8, 16, 32) * 20:
        cheap.record(rows, rows, 0.030 + 0.0005 * rows)
    run = DraftWindow(32, cheap).start(busy_slots=1)
    while run.offer(0.999):
        pass
    assert run.position > DraftWindow.TRIAL


# ---------------------------------------------------------------------------------------------------------- first trial
# Before any draft was verified, what a row costs is a guess. These figures are the MLX CPU build's (qwen2.5-coder
# 1.5B, drafted by its 0.5B), where every row multiplies the weights again: a prompt row 0.9 s, a one-row step 1.1 s,
# a draft token 0.35 s; and a GPU's, where a prompt row costs a fiftieth of a step.


def _first_step(prompt_row_seconds: float, step_seconds: float, *, prompt_rows: int = 246) -> DepthCosts:
    costs = DepthCosts()
    costs.observe_prompt(prompt_rows, prompt_rows * prompt_row_seconds)
    costs.record(1, 1, step_seconds, depth=prompt_rows)
    costs.at(prompt_rows + 1)
    return costs


def test_a_prompt_row_as_dear_as_a_step_keeps_a_priced_draft_model_from_its_first_trial():
    dear = _first_step(0.9, 1.1)
    assert not any_draft_pays(dear.current, 1, draft_seconds=0.35)
    # Without the prompt's word the prior finds rows cheap, and the same draft model looks worth a trial.
    unknown = _first_step(0.9, 1.1, prompt_rows=8)  # a chunk too small to price a row (its fixed part)
    assert unknown.prompt_row is None
    assert any_draft_pays(unknown.current, 1, draft_seconds=0.35)


def test_a_prompt_row_cheap_beside_a_step_still_lets_drafts_be_tried():
    gpu = _first_step(0.0002, 0.01)
    assert gpu.current.seconds(9) < 2 * gpu.current.seconds(1)
    assert any_draft_pays(gpu.current, 1, draft_seconds=0.002)


class _ScriptedSource:
    """A DraftSource that is sure of token 7 every time, at a given price per token."""

    n_vocab, n_ctx = 16, 512

    def __init__(self, price: float):
        self.seconds_per_token, self.begun = price, 0

    def begin(self, seq, tokens) -> np.ndarray:
        self.begun += 1
        return self.advance(seq, 0, len(tokens))

    def advance(self, seq, token, pos) -> np.ndarray:
        logits = np.full(self.n_vocab, -30.0, dtype=np.float32)
        logits[7] = 0.0
        return logits

    def end(self, seq, n_tokens) -> None: ...

    def accept(self, seq, *, start, accepted) -> None: ...

    def close(self) -> None: ...


def test_a_source_that_cannot_pay_is_never_asked_to_catch_up():
    tokens = list(range(200))
    dear = _ScriptedSource(0.35)
    assert draft_from(dear, 0, tokens, DraftWindow(8, _first_step(0.9, 1.1)), busy_slots=1, room=8) == []
    assert dear.begun == 0  # its catch-up of the whole prompt would have cost more than the answer
    cheap = _ScriptedSource(0.002)
    assert draft_from(cheap, 0, tokens, DraftWindow(8, _first_step(0.0002, 0.01)), busy_slots=1, room=8)[:1] == [7]
    assert cheap.begun == 1
