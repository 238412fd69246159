"""The thread tuner on plain data: synthetic step times of an idle machine, a contended one, and one whose load
changes. No timing is measured here; the machine is a formula."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localllm.engine.threads import FAR, TRIAL_SHAPES, ThreadTuner
from localllm.machine import _linux_cores, physical_cores

ROUND = TRIAL_SHAPES["decode"].steps  # steps of one count in a round of a decode trial: a warm-up, then measured
TRIAL = 3 * ROUND  # steps of one count in a whole trial of three rounds (two when the counts stand apart)


def machine(cores: int, busy: int = 0):
    """Seconds of a decode step: the work splits over the threads, but a thread without a free core of its own stalls
    every step (llama.cpp's threads wait for each other), the collapse measured on two cores with one busy."""
    free = cores - busy

    def step(threads: int, rows: int) -> float:
        seconds = 0.010 * (1 + 0.2 * rows) / threads
        return seconds * (4.0 if threads > free else 1.0)

    return step


def run(tuner: ThreadTuner, step, n: int, *, rows: int = 1, kind: str = "decode") -> list[int]:
    """Drive the tuner for n steps; the thread counts it chose."""
    used = []
    for _ in range(n):
        threads = tuner.choose(kind)
        tuner.record(kind, threads, rows, step(threads, rows))
        used.append(threads)
    return used


def test_idle_machine_settles_on_every_core():
    tuner = ThreadTuner(4)
    used = run(tuner, machine(4), TRIAL * 4 + 20)
    # One trial: the count in use (every core) first, then the others, each a warm-up step and its measured steps;
    # every core stands FAR ahead of three after one round, so no second round is run.
    assert used[: ROUND * 4] == [t for t in (4, 1, 2, 3) for _ in range(ROUND)]
    assert tuner.settled("decode") == 4 and set(used[ROUND * 4 :]) == {4}
    assert tuner.trial_steps("decode") == ROUND * 4


def test_a_busy_core_settles_on_the_free_ones():
    tuner = ThreadTuner(2)
    run(tuner, machine(2, busy=1), TRIAL * 2)
    assert tuner.settled("decode") == 1


def test_load_arriving_moves_to_fewer_threads_and_leaving_moves_back():
    tuner = ThreadTuner(2, patience=4, recheck=200)
    run(tuner, machine(2), TRIAL * 2)
    assert tuner.settled("decode") == 2
    used = run(tuner, machine(2, busy=1), 4 + TRIAL * 2 + 10)  # patience slow steps, then a trial
    assert tuner.settled("decode") == 1 and used[-10:] == [1] * 10
    # Begun by the slowdown: the slowed count's latest steps are its samples, so only one thread runs in the trial.
    slowed = used.index(1)
    assert slowed <= 4 and set(used[slowed:]) == {1}
    assert tuner.trial_steps("decode") == TRIAL  # the window still held steps from before the load: three rounds
    # The load goes away: nothing looks slow at one thread, so the periodic re-check finds two threads again.
    used = run(tuner, machine(2), 200 + TRIAL * 2 + 5)
    assert tuner.settled("decode") == 2 and used[-5:] == [2] * 5


def test_a_new_batch_shape_is_not_mistaken_for_a_slowdown():
    tuner = ThreadTuner(2, patience=3, recheck=10_000)
    step = machine(2)
    run(tuner, step, TRIAL * 2, rows=4)
    trials_before = tuner._kinds["decode"].settles
    run(tuner, step, 50, rows=1)  # one row costs more per row than four, at the same thread count
    assert tuner._kinds["decode"].settles == trials_before  # no new trial
    assert tuner.settled("decode") == 2


def test_decode_and_batch_steps_settle_apart():
    tuner = ThreadTuner(2)

    def prefill_prefers_two_decode_prefers_one(threads: int, rows: int) -> float:
        return 0.001 * rows / threads if rows > 8 else 0.01 * threads

    for _ in range(TRIAL * 2):
        for kind, rows in (("decode", 1), ("batch", 512)):
            threads = tuner.choose(kind)
            tuner.record(kind, threads, rows, prefill_prefers_two_decode_prefers_one(threads, rows))
    assert tuner.settled("decode") == 1 and tuner.settled("batch") == 2


def _both_kinds(tuner: ThreadTuner, step, n: int, *, prefill_cost=None) -> list[int]:
    """n rounds of a decode step and a 256-row prefill chunk (its per-row cost scaled by prefill_cost(i)); the
    counts the chunks ran at."""
    used = []
    for i in range(n):
        threads = tuner.choose("decode")
        tuner.record("decode", threads, 1, step(threads, 1))
        threads = tuner.choose("batch")
        tuner.record("batch", threads, 256, step(threads, 256) * (prefill_cost(i) if prefill_cost else 1.0))
        used.append(threads)
    return used


def test_prefill_chunks_deeper_in_a_prompt_start_no_trial():
    # Chunks cost more a row as the prompt grows (attention over more cells): not a sign of another process.
    tuner = ThreadTuner(2, patience=4, recheck=10_000, first_recheck=10_000)
    _both_kinds(tuner, machine(2), TRIAL * 2)
    settles = tuner._kinds["batch"].settles
    used = _both_kinds(tuner, machine(2), 40, prefill_cost=lambda i: 1.0 + 0.05 * i)  # up to 3x slower
    assert set(used) == {2} and tuner._kinds["batch"].settles == settles


def test_prefill_tries_its_counts_again_when_decode_steps_move():
    tuner = ThreadTuner(2, patience=4, recheck=10_000, first_recheck=10_000)
    _both_kinds(tuner, machine(2), TRIAL * 2)
    assert tuner.settled("decode") == 2 and tuner.settled("batch") == 2
    used = _both_kinds(tuner, machine(2, busy=1), TRIAL * 2 + 5)  # another process takes a core
    assert tuner.settled("decode") == 1 and tuner.settled("batch") == 1
    assert used[-5:] == [1] * 5


def test_counts_that_overlap_run_all_three_rounds():
    tuner = ThreadTuner(2)
    noise = iter([0.9, 1.1] * 100)  # steps alternate fast and slow whatever the count

    def noisy(threads: int, rows: int) -> float:
        return 0.010 / threads**0.1 * next(noise)

    run(tuner, noisy, TRIAL * 2)
    assert tuner.trial_steps("decode") == TRIAL * 2 and tuner.settled("decode") == 2


def test_a_prefill_trial_measures_every_chunk():
    # Prefill chunks are long and few (one per turn): no warm-up steps. The default (every core) runs first, and a
    # first trial that finds it far ahead ends after one round: a first long prompt runs one chunk at the lost count.
    tuner = ThreadTuner(2)
    used = run(tuner, machine(2), 5, rows=256, kind="batch")
    assert used == [2, 1, 2, 2, 2] and tuner.settled("batch") == 2 and tuner.trial_steps("batch") == 2


def test_a_first_trial_leaves_the_default_only_after_two_rounds():
    # One round could have met a passing load while the default ran: fewer threads far ahead still take two rounds.
    tuner = ThreadTuner(2)
    used = run(tuner, machine(2, busy=1), 6, rows=256, kind="batch")
    assert used == [2, 1, 2, 1, 1, 1] and tuner.settled("batch") == 1 and tuner.trial_steps("batch") == 4


def test_a_default_ahead_by_less_than_far_runs_two_rounds():
    def close(threads: int, rows: int) -> float:
        return 0.001 * rows / threads**0.2  # two threads 1.15x ahead: not far

    tuner = ThreadTuner(2)
    used = run(tuner, close, 6, rows=256, kind="batch")
    assert FAR > 2**0.2
    assert used == [2, 1, 2, 1, 2, 2] and tuner.settled("batch") == 2 and tuner.trial_steps("batch") == 4


def test_one_core_never_tries_anything():
    tuner = ThreadTuner(1)
    assert run(tuner, machine(1), 20) == [1] * 20


def test_ties_go_to_fewer_threads():
    tuner = ThreadTuner(3)
    run(tuner, lambda threads, rows: 0.01, TRIAL * 3)
    assert tuner.settled("decode") == 1


def time_sliced(fast_share: float):
    """Two cores, one taken by a process the OS slices in and out: two threads run a step at full speed while it is
    off the CPU and stall 8x while it is on; one thread shares its core at a steady 0.6 of full speed. Two threads'
    steps are fast more often than not, yet take longer on average than one thread's."""
    steps = [0]

    def step(threads: int, rows: int) -> float:
        steps[0] += 1
        if threads == 1:
            return 0.010 * rows / 0.6
        fast = (steps[0] * 0.618) % 1 < fast_share  # a fixed scatter of fast and slow steps
        return 0.005 * rows * (1 if fast else 8)

    return step


def test_counts_are_compared_by_their_mean_step_not_a_lucky_median():
    tuner = ThreadTuner(2)
    run(tuner, time_sliced(0.6), TRIAL * 2)
    assert tuner.settled("decode") == 1  # two threads: median 5 ms, mean about 19 ms a row; one thread 17 ms


def test_a_slowdown_of_scattered_slow_steps_is_seen():
    tuner = ThreadTuner(2, recheck=10_000, first_recheck=10_000)
    run(tuner, machine(2), TRIAL * 2)
    assert tuner.settled("decode") == 2
    # The load arrives: most two-thread steps are as fast as before, but never six slow ones in a row.
    used = run(tuner, time_sliced(0.6), 6 + TRIAL * 2 + 10)
    assert tuner.settled("decode") == 1 and used[-10:] == [1] * 10


def test_a_lone_slow_step_starts_no_trial():
    tuner = ThreadTuner(2, recheck=10_000, first_recheck=10_000)
    run(tuner, machine(2), TRIAL * 2)
    settles = tuner._kinds["decode"].settles
    steady = machine(2)
    steps = iter(range(10_000))

    def a_hiccup_every_twenty(threads: int, rows: int) -> float:  # a garbage collection, a page fault: 6x one step
        return steady(threads, rows) * (6 if next(steps) % 20 == 19 else 1)

    run(tuner, a_hiccup_every_twenty, 200)
    assert tuner._kinds["decode"].settles == settles and tuner.settled("decode") == 2
    run(tuner, time_sliced(0.6), 6 + TRIAL * 2 + 10)  # while a load that slows a share of the steps is still seen
    assert tuner.settled("decode") == 1


def test_a_slowdown_that_the_other_counts_do_not_beat_keeps_the_settled_count():
    tuner = ThreadTuner(2, recheck=10_000, first_recheck=10_000)
    run(tuner, machine(2), TRIAL * 2)
    slower = machine(2)

    def everything_slower(threads: int, rows: int) -> float:  # the machine slows down alike for every count
        return slower(threads, rows) * 1.6

    used = run(tuner, everything_slower, 6 + TRIAL + 20)
    assert tuner.settled("decode") == 2 and used[-20:] == [2] * 20
    assert tuner._kinds["decode"].settles == 2  # one trial, of one thread only; its new baseline is the slower one


def test_retry_tries_the_counts_again_at_the_next_step():
    tuner = ThreadTuner(2, recheck=10_000, first_recheck=10_000)
    run(tuner, machine(2, busy=1), TRIAL * 2)  # the load check's trial ran beside the first request
    run(tuner, machine(2), 50)
    assert tuner.settled("decode") == 1  # nothing looks slow at one thread, and no re-check is due
    tuner.retry()  # its child has ended
    used = run(tuner, machine(2), TRIAL * 2 + 5)
    assert used[:ROUND] == [1] * ROUND and used[ROUND : 2 * ROUND] == [2] * ROUND
    assert tuner.settled("decode") == 2 and used[-5:] == [2] * 5


@pytest.mark.models
def test_an_engine_told_the_machine_changed_tries_its_counts_again(smollm2_path):
    from localllm.api import LoadOptions, SamplingOptions
    from localllm.backends.llama_cpp.backend import LlamaCppBackend
    from localllm.engine.runner import GenerationParams, ModelEngine

    # No re-check by time or slowdown: only the engine's word starts a trial after the first.
    tuner = ThreadTuner(2, recheck=10_000, first_recheck=10_000, slowdown=1e9)
    model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_ctx=256, num_parallel=1))
    engine = ModelEngine(model, max_queue=1, threads=tuner)
    sampling = SamplingOptions(temperature=0, num_predict=30, ignore_eos=True, spec_type="none")

    def generate() -> None:
        list(engine.submit(GenerationParams(engine.tokenize("Once upon a time"), sampling)))

    try:
        generate()
        generate()
        settled = tuner._kinds["decode"].settles
        assert settled == 1
        engine.machine_changed()
        generate()
        assert tuner._kinds["decode"].settles == settled + 1
    finally:
        engine.close()


def test_more_threads_must_win_by_the_margin():
    tuner = ThreadTuner(2, margin=1.05)
    run(tuner, lambda threads, rows: 0.010 if threads == 1 else 0.0098, TRIAL * 2)
    assert tuner.settled("decode") == 1  # 2% faster: not worth a core
    tuner = ThreadTuner(2, margin=1.05)
    run(tuner, lambda threads, rows: 0.010 if threads == 1 else 0.009, TRIAL * 2)
    assert tuner.settled("decode") == 2


def test_physical_cores_count_hyperthread_siblings_once(tmp_path: Path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert _linux_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert _linux_cores({0, 2}, tmp_path) == 1  # two siblings of one core
    assert _linux_cores({0, 9}, tmp_path) == 0  # unreadable topology: the caller falls back


def test_the_first_step_after_a_change_of_count_is_not_measured():
    last = [0]

    def starting_threads_costs_once(threads: int, rows: int) -> float:
        # llama.cpp's OpenMP team starts its threads at the first step with a new count: a one-off cost.
        switched, last[0] = threads != last[0], threads
        return 0.010 / threads + (0.050 if switched and threads > 1 else 0.0)

    tuner = ThreadTuner(2)
    run(tuner, starting_threads_costs_once, TRIAL * 2)
    assert tuner.settled("decode") == 2


def test_a_load_that_passes_during_the_first_trial_is_corrected_soon():
    tuner = ThreadTuner(2, first_recheck=64, recheck=1024)
    run(tuner, machine(2, busy=1), TRIAL * 2)  # another program's threads were still winding down
    assert tuner.settled("decode") == 1
    used = run(tuner, machine(2), 64 + TRIAL * 2 + 5)  # nothing looks slow at one thread: the early re-check
    assert tuner.settled("decode") == 2 and used[-5:] == [2] * 5
    run(tuner, machine(2), 64 + TRIAL * 2)  # confirmed: the next re-check waits twice as long
    assert tuner._kinds["decode"].interval == 128
    # and a re-check that finds the settled count ends at the other count's first measured step
    assert tuner.trial_steps("decode") == ROUND + TRIAL_SHAPES["decode"].warm_up + 1


def test_a_recheck_under_load_runs_one_measured_step_at_the_losing_count():
    # Beside a busy core a two-thread step can stall many times over: a re-check that finds the settled count
    # standing apart again stops there, and the losing count runs its warm-up and one measured step, not a round.
    tuner = ThreadTuner(2, first_recheck=64, recheck=1024)
    run(tuner, machine(2, busy=1), TRIAL * 2)
    assert tuner.settled("decode") == 1
    used = run(tuner, machine(2, busy=1), 64 + ROUND + 10)
    other = used.index(2)
    assert used[other:] == [2, 2] + [1] * (len(used) - other - 2)
    assert tuner.trial_steps("decode") == ROUND + 2
    assert tuner.settled("decode") == 1 and tuner._kinds["decode"].interval == 128


def test_a_recheck_ends_early_only_once_every_count_has_run():
    tuner = ThreadTuner(4, first_recheck=64, recheck=1024)
    run(tuner, machine(4), TRIAL * 4)
    assert tuner.settled("decode") == 4
    used = run(tuner, machine(4), 64 + ROUND * 4)
    # The re-check: four first, then 1 and 2 a round each; 3, the last, stops at its first measured step.
    other = used.index(1)
    assert used[other:] == [1] * ROUND + [2] * ROUND + [3, 3] + [4] * (len(used) - other - 2 * ROUND - 2)
    assert tuner.settled("decode") == 4


@pytest.mark.models
def test_a_model_loaded_at_the_defaults_tunes_its_threads(models_home, monkeypatch):
    # The server's path: options bounded against the machine, the pool's engine; ps says the count is chosen as it runs.
    from server_harness import local_client

    from localllm import api

    monkeypatch.delenv("LOCALLLM_NUM_THREAD", raising=False)
    client = local_client(models_home)
    try:
        request = api.GenerateRequest(model="smollm2:135m", prompt="Hi", options={"num_predict": 4, "temperature": 0})
        assert [chunk for chunk in client.generate(request) if chunk.done]
        (row,) = client.ps().models
    finally:
        client.close()
    assert row.threads_auto and 1 <= row.threads <= physical_cores()


def test_openmp_waits_are_set_before_llama_cpp_loads_unless_the_user_set_them(monkeypatch):
    from localllm import machine

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(machine, "_llama_cpp_uses_libgomp", lambda: True)
    machine.keep_openmp_barriers_spinning()
    assert (os.environ["OMP_WAIT_POLICY"], os.environ["GOMP_SPINCOUNT"]) == ("active", "300000")

    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    machine.keep_openmp_barriers_spinning()
    assert os.environ["OMP_WAIT_POLICY"] == "passive" and "GOMP_SPINCOUNT" not in os.environ

    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(machine, "_llama_cpp_uses_libgomp", lambda: False)  # LLVM's OpenMP would spin forever
    machine.keep_openmp_barriers_spinning()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_installed_llama_cpp_is_read_for_libgomp_without_loading_it():
    import subprocess
    import sys

    code = (
        "import sys, localllm.machine as m; uses = m._llama_cpp_uses_libgomp(); print(uses, 'llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    lib = next(Path(__import__("llama_cpp").__file__).parent.joinpath("lib").glob("libggml-cpu*.so*"))
    assert out == [str(b"libgomp.so" in lib.read_bytes()), "False"]
