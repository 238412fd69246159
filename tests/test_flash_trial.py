"""Flash attention on a CPU, chosen per model by the load probe's trial (llama_cpp/flash_trial.py): the rule that reads
the timings, the trial itself on a real (tiny) model, its memory beside the probe's, and the pool running the context
as the trial found, only where the load leaves the choice open."""

from __future__ import annotations

import json
import threading

import llama_cpp
import pytest
from server_harness import linked_home, local_client
from tiny_models import write_tiny_llama

from localllm import api
from localllm.backends.llama_cpp import flash_trial, probe
from localllm.backends.llama_cpp.flash_trial import FlashTrial, StepTimes, affordable_depth
from localllm.backends.llama_cpp.probe import LoadProbe, Probed, weights_key


def _trial(on: tuple[float, float, float], off: tuple[float, float, float]) -> FlashTrial:
    return FlashTrial(depth=256, threads=2, on=StepTimes(*on), off=StepTimes(*off))


def test_off_is_chosen_only_when_clearly_faster_at_depth():
    # smollm2 on 2 cores, as measured: off 35% faster at depth, its prefill 6% slower.
    assert _trial(on=(0.651, 0.088, 0.0166), off=(0.691, 0.056, 0.0123)).flash_attn is False
    # gemma3: level. llama.cpp's own choice stands.
    assert _trial(on=(0.344, 0.043, 0.021), off=(0.345, 0.045, 0.021)).flash_attn is None
    # Faster at depth, but a first turn would pay for it: left as it is.
    assert _trial(on=(0.5, 0.1, 0.02), off=(0.8, 0.05, 0.01)).flash_attn is None
    # Off slower: on is what "auto" runs on a CPU anyway.
    assert _trial(on=(0.5, 0.05, 0.01), off=(0.5, 0.1, 0.02)).flash_attn is None


def test_the_trial_goes_as_deep_as_its_time_allows_and_no_deeper():
    assert affordable_depth(1e-6) == flash_trial.MAX_DEPTH
    seconds = flash_trial.TRIAL_SECONDS / 200  # 200 tokens fit: the depth is a whole number of first chunks
    assert affordable_depth(seconds) == 200 // flash_trial.FIRST_CHUNK * flash_trial.FIRST_CHUNK
    assert affordable_depth(flash_trial.TRIAL_SECONDS / (flash_trial.MIN_DEPTH - 1)) == 0  # too slow to learn


def test_a_trial_is_read_back_only_as_written():
    trial = _trial(on=(0.6, 0.09, 0.017), off=(0.7, 0.05, 0.012))
    assert FlashTrial.from_json(json.loads(json.dumps(trial.to_json()))) == trial
    for bad in (None, [], {"depth": 256}, {**trial.to_json(), "on": {"prefill": "x"}}, {**trial.to_json(), "off": 3}):
        assert FlashTrial.from_json(bad) is None


def test_the_finding_applies_only_where_the_load_leaves_flash_attention_open():
    found = Probed(trial=_trial(on=(0.6, 0.09, 0.017), off=(0.6, 0.05, 0.012)))
    assert found.applied_to(api.LoadOptions()).flash_attn is False
    assert found.applied_to(api.LoadOptions(flash_attn=True)).flash_attn is True  # the user's word stands
    assert found.applied_to(api.LoadOptions(kv_type="q8_0")).flash_attn is None  # a quantized V needs it on
    assert found.applied_to(api.LoadOptions(rpc="127.0.0.1:50052")).flash_attn is None  # the workers' devices decide
    assert Probed().applied_to(api.LoadOptions()).flash_attn is None
    level = Probed(trial=_trial(on=(0.6, 0.05, 0.012), off=(0.6, 0.05, 0.012)))
    assert level.applied_to(api.LoadOptions()).flash_attn is None


def test_the_probe_times_both_settings_and_remembers_the_trial(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    memory = LoadProbe(tmp_path / "probes")
    first = memory.check(path, api.LoadOptions())
    assert first.trial is None and first.trial_due  # the trial is never on the request path...
    _run_due_trial(tmp_path / "probes", path)
    trial = memory.check(path, api.LoadOptions()).trial  # ...it runs in the background after the load, for the next
    assert trial is not None  # a tiny model affords the deepest trial on any machine
    assert trial.depth == flash_trial.MAX_DEPTH and trial.threads >= 1
    assert all(t > 0 for times in (trial.on, trial.off) for t in (times.prefill, times.short_batch, times.one_token))
    remembered = json.loads((tmp_path / "probes" / weights_key(path)).read_text())
    assert FlashTrial.from_json(remembered["flash_trial"]) == trial

    def no_child(*args, **kwargs):
        raise AssertionError("a remembered file was probed again")

    monkeypatch.setattr(probe, "_run_child", no_child)
    assert memory.check(path, api.LoadOptions()).trial == trial


def test_no_trial_where_the_choice_is_not_open(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    checked = LoadProbe(tmp_path / "probes").check(path, api.LoadOptions(flash_attn=True))
    assert checked.trial is None and not checked.trial_due


def test_weights_probed_before_the_trial_existed_are_probed_again(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    entry = tmp_path / "probes" / weights_key(path)
    entry.parent.mkdir()
    entry.write_text(json.dumps({**probe._record(), "probe": "1"}))  # what the probe before the trial wrote
    assert LoadProbe(tmp_path / "probes").check(path, api.LoadOptions()).trial_due
    _run_due_trial(tmp_path / "probes", path)
    assert LoadProbe(tmp_path / "probes").check(path, api.LoadOptions()).trial is not None


def test_a_success_whose_trial_never_finished_starts_it_again(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    entry = tmp_path / "probes" / weights_key(path)
    entry.parent.mkdir()
    entry.write_text(json.dumps({**probe._record(), "flash_trial": None, "trial_done": False}))  # a server stopped
    again = LoadProbe(tmp_path / "probes").check(path, api.LoadOptions())
    assert again.trial is None and again.trial_due  # no child on the path: the trial is due after the load
    assert probe.trial_pending(entry)  # what the benchmark's servers wait on
    _run_due_trial(tmp_path / "probes", path)
    assert json.loads(entry.read_text())["trial_done"] is True
    checked = LoadProbe(tmp_path / "probes").check(path, api.LoadOptions())
    assert checked.trial is not None and not checked.trial_due
    assert not probe.trial_pending(entry)
    entry.write_text(json.dumps({**probe._record(), "llama_cpp": "0.0.1", "trial_done": False}))
    assert not probe.trial_pending(entry)  # another llama.cpp's memory: nothing this one would run


def test_a_background_trial_says_when_it_has_ended(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    memory = tmp_path / "probes"
    assert LoadProbe(memory).check(path, api.LoadOptions()).trial_due
    ended = threading.Event()
    probe.start_trial(memory, path, api.LoadOptions(), ended.set)  # the pool passes its engine's machine_changed
    probe.wait_for_trials()
    assert ended.is_set() and json.loads((memory / weights_key(path)).read_text())["trial_done"] is True


def _run_due_trial(memory, path) -> None:
    """What the pool does once the weights have loaded: start the due trial (here, and wait for it)."""
    probe.start_trial(memory, path, api.LoadOptions())
    probe.wait_for_trials()


def _context_flash(client) -> str:
    (entry,) = client.pool.entries()
    return entry.engine.model.cache_shape().fingerprint.rsplit("flash ", 1)[1]


@pytest.mark.models
def test_the_pool_runs_the_context_as_the_trial_found(models_home, tmp_path, monkeypatch):
    """A trial that found off faster (written into this home's probe memory) turns it off for a load that leaves it
    open, and `ps` says it was measured; a request that names a setting gets that setting."""
    monkeypatch.delenv("LOCALLLM_FLASH_ATTENTION", raising=False)
    home = linked_home(models_home, tmp_path / "home")
    client = local_client(home)
    weights = client.store.resolve("smollm2:135m").weights
    faster_off = _trial(on=(0.6, 0.09, 0.017), off=(0.6, 0.05, 0.012))
    entry = home / "models" / "probes" / weights_key(weights)
    entry.parent.mkdir(exist_ok=True)
    entry.write_text(json.dumps({**probe._record(), "flash_trial": faster_off.to_json()}))
    try:
        for options, flash, measured, native in (
            ({}, False, True, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED),
            ({"flash_attn": True}, True, False, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
        ):
            request = api.GenerateRequest(
                model="smollm2:135m", prompt="Hi", options={"num_predict": 2, "temperature": 0, **options}
            )
            assert [chunk for chunk in client.generate(request) if chunk.done]
            (row,) = client.ps().models
            assert (row.flash_attn, row.flash_attn_measured) == (flash, measured)
            assert _context_flash(client) == str(native)
    finally:
        client.close()


def test_a_model_too_slow_for_the_trial_keeps_llama_cpp_s_choice(tmp_path, monkeypatch):
    # A single token slower than the limit (here any token: a big model on a small CPU) stops the trial before it
    # spends seconds on a sizing chunk, at every thread count.
    monkeypatch.setattr(flash_trial, "ONE_TOKEN_LIMIT", 0.0)
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    assert flash_trial.run_trial(path, api.LoadOptions()) is None


def test_a_draft_models_trial_tells_the_engine_when_it_has_ended(tmp_path):
    from functools import partial

    from localllm.engine.pool import ModelPool
    from localllm.engine.speculative.speculation import load_speculation
    from localllm.models.create import create_model
    from localllm.models.store import Store

    store = Store(tmp_path / "models")
    for name, seed in (("target", 0), ("drafter", 1)):
        path = write_tiny_llama(tmp_path / f"{name}.gguf", seed=seed)
        for _ in create_model(api.CreateRequest(model=name, **{"from": str(path)}), store):
            pass
    pool = ModelPool(store, speculation_factory=partial(load_speculation, store))
    try:
        with pool.acquire(store.resolve("target"), api.LoadOptions(num_ctx=64)):
            pass
        probe.wait_for_trials()  # the target's own trial is remembered: the next load starts none
        with pool.acquire(store.resolve("target"), api.LoadOptions(num_ctx=64, draft="drafter")) as loaded:
            assert loaded.speculation is not None and loaded.speculation.draft_model is not None
            probe.wait_for_trials()
            # The engine heard of it (machine_changed), as of the target's trial: its thread counts are tried again.
            assert loaded.engine._machine_changed.is_set()
            drafter = store.resolve("drafter").weights
            assert json.loads((store.root / "probes" / weights_key(drafter)).read_text())["trial_done"] is True
    finally:
        pool.close()
