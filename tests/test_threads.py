"""The thread tuner on plain data: recorded windows of what the OS said (CPU time, other processes' CPU, the run
queue), and a formula machine behind the tuner's Probe. No timing is measured here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localllm import machine as machine_facts
from localllm.engine.threads import (
    HANDOFF_SECONDS,
    PAUSE_SECONDS,
    STEADY_WINDOWS,
    WINDOW_SECONDS,
    ThreadPolicy,
    ThreadTuner,
    Window,
)
from localllm.machine import _linux_cores, cgroup_cpu_budget, physical_cores

QUIET = 0.05  # cores' worth of CPU a quiet machine's daemons use


def at(threads: int, *, elsewhere: float | None = QUIET, share: float = 0.97) -> Window:
    """A window of steps at `threads`, its threads getting `share` of their wall time on a CPU."""
    return Window(threads, WINDOW_SECONDS, share * threads * WINDOW_SECONDS, elsewhere)


def pause(*, elsewhere: float, runnable: int, seconds: float = 2.0, ours: float = 0.0) -> Window:
    return Window(0, seconds, ours * seconds, elsewhere, runnable)


def feed(policy: ThreadPolicy, windows: list[Window], *, fresh: bool = False) -> list[int]:
    """The count after each window."""
    return [policy.observe(w, fresh=fresh) for w in windows]


# Recorded on two cores with `yes` holding one: beside two of our threads it gets about two thirds of a core, and our
# threads about two thirds of their wall time each; beside one thread it has its core to itself.
CONTENDED_AT_2 = at(2, elsewhere=0.68, share=0.66)
CONTENDED_AT_1 = at(1, elsewhere=1.0, share=0.99)


def test_the_first_choice_is_every_core_llama_cpp_would_use():
    assert ThreadPolicy(4, cpus=8).count == 4
    tuner = ThreadTuner(4, probe=FormulaMachine(cpus=4))
    assert tuner.choose("batch") == 4 and tuner.choose("decode") == 4  # no trial at fewer threads first


def test_a_noisy_window_does_not_move_it():
    policy = ThreadPolicy(2)
    # One window meets another program's burst; where the OS says nothing of others, one finds our threads short of
    # CPU (a page fault storm): each alone.
    assert feed(policy, [at(2), CONTENDED_AT_2, at(2), at(2, elsewhere=None, share=0.5), at(2)]) == [2] * 5
    # A pause that held a burst (both cores busy on average) which has ended: nobody else is runnable now.
    assert feed(policy, [pause(elsewhere=1.9, runnable=0)]) == [2]
    assert policy.moves == 0


def test_a_real_contention_moves_it_and_its_end_moves_it_back():
    policy = ThreadPolicy(2)
    assert feed(policy, [at(2), CONTENDED_AT_2, CONTENDED_AT_2]) == [2, 2, 1]
    # At one thread the other process has its core: the OS says so every window, however fast our steps are.
    assert feed(policy, [CONTENDED_AT_1] * 10) == [1] * 10
    # It ends: one quiet window may be a lull, two are not.
    assert feed(policy, [at(1), at(1), at(1)]) == [1, 2, 2]


def test_threads_starved_of_cpu_move_it_where_the_os_says_nothing_of_others():
    policy = ThreadPolicy(4)
    assert feed(policy, [at(4, elsewhere=None, share=0.6)] * 2) == [4, 3]
    assert feed(policy, [at(3, elsewhere=None, share=0.7)] * 2) == [3, 2]
    # Nothing else can say the load ended: two windows unstarved try every core again (and a try taken back at
    # once makes the next wait longer: test_a_move_up_taken_back_at_once_waits_longer_the_next_time).
    assert feed(policy, [at(2, elsewhere=None)] * 2) == [2, 4]


def test_a_move_up_taken_back_at_once_waits_longer_the_next_time():
    # No account from the OS, and a load that starves two threads and never ends: only trying tells.
    policy = ThreadPolicy(2)
    counts = []
    for _ in range(40):
        window = at(2, elsewhere=None, share=0.6) if policy.count == 2 else at(1, elsewhere=None)
        counts.append(policy.observe(window))
    ups = sum(1 for a, b in zip(counts, counts[1:], strict=False) if b > a)
    assert ups == 4  # up after 2, 4, 8 and 16 windows, each taken back after 2: not 10 ups, one every 4 windows
    assert counts.count(1) > counts.count(2)


def test_a_pause_meets_a_load_still_running_before_the_first_step():
    policy = ThreadPolicy(2)
    assert feed(policy, [pause(elsewhere=1.0, runnable=1)]) == [1]
    # and a pause after it has ended returns at once: a prefill never waits at half the threads for two windows
    assert feed(policy, [pause(elsewhere=0.4, runnable=0)]) == [2]
    # this process's other engine held a core through the pause, and runs now
    assert feed(policy, [pause(elsewhere=0.0, runnable=1, ours=1.0)]) == [1]


def test_the_os_account_decides_over_starved_threads():
    # Our threads short of CPU with no other process on our CPUs: this process's own work (a second model), which
    # fewer threads here would not free.
    policy = ThreadPolicy(2)
    assert feed(policy, [at(2, elsewhere=0.0, share=0.5)] * 4) == [2] * 4


def test_a_fresh_window_raises_the_count_alone_but_never_lowers_it():
    policy = ThreadPolicy(2)
    feed(policy, [CONTENDED_AT_2] * 2)
    assert policy.observe(at(1), fresh=True) == 2
    assert policy.observe(CONTENDED_AT_2, fresh=True) == 2


class FormulaMachine:
    """A Probe over a machine made of formulas: `others` cores' worth of work from other processes, this process's
    threads and theirs sharing the CPUs alike once they are more than the CPUs (as Linux's scheduler shares them),
    and a step at `threads` stalling 4x when one of them has no core of its own."""

    def __init__(self, cpus: int = 2, others: float = 0.0):
        self.n_cpus, self.others = cpus, others
        self.t = self.cpu = self.busy_s = 0.0
        self.lingering: list[int] = []  # run queue readings of a load that has just ended, read before the formula

    def run_step(self, threads: int) -> float:
        """Run one decode step at `threads`; its wall seconds."""
        seconds = 0.010 / threads
        demand = threads + self.others
        if demand > self.n_cpus:
            seconds *= 4.0
        scale = min(1.0, self.n_cpus / demand)
        self._advance(seconds, ours=threads * scale, theirs=self.others * scale)
        return seconds

    def idle(self, seconds: float) -> None:
        self._advance(seconds, ours=0.0, theirs=min(self.others, self.n_cpus))

    def _advance(self, seconds: float, *, ours: float, theirs: float) -> None:
        self.t += seconds
        self.cpu += ours * seconds
        self.busy_s += (ours + theirs) * seconds

    def now(self) -> float:
        return self.t

    def process_cpu(self) -> float:
        return self.cpu

    def busy(self) -> float | None:
        return self.busy_s

    def runnable(self) -> int | None:
        if self.lingering:
            return 1 + self.lingering.pop(0)
        return 1 + round(self.others)  # the engine thread asking, and the others' threads

    def cpus(self) -> int:
        return self.n_cpus

    def wait(self, seconds: float) -> None:
        self.idle(seconds)


def steps(tuner: ThreadTuner, box: FormulaMachine, n: int, kind: str = "decode") -> list[int]:
    used = []
    for _ in range(n):
        threads = tuner.choose(kind)  # type: ignore[arg-type]
        tuner.record(kind, threads, 1, box.run_step(threads))  # type: ignore[arg-type]
        used.append(threads)
    return used


def test_the_tuner_follows_a_load_through_its_probe():
    box = FormulaMachine(cpus=2)
    tuner = ThreadTuner(2, probe=box)
    assert set(steps(tuner, box, 100)) == {2}
    box.others = 1.0  # a build starts on one core
    used = steps(tuner, box, 200)
    stalled = used.index(1)
    assert set(used[stalled:]) == {1}
    assert stalled * 0.010 / 2 * 4 <= HOLD_WALL  # two windows of stalled steps at most, not a whole request
    box.others = 0.0
    used = steps(tuner, box, 200)
    assert used[-1] == 2 and used[:10] == [1] * 10  # back after two quiet windows


HOLD_WALL = 2 * WINDOW_SECONDS + 0.02  # two windows and the step that ends the second


def test_a_request_after_a_pause_starts_on_what_the_machine_holds_now():
    box = FormulaMachine(cpus=2)
    tuner = ThreadTuner(2, probe=box)
    steps(tuner, box, 50)
    box.others = 1.0
    box.idle(3.0)  # a core taken while the engine waited
    assert steps(tuner, box, 5) == [1] * 5  # no stalled step at all
    box.others = 0.0
    box.idle(PAUSE_SECONDS)  # ended before the next request: its prefill runs on every core
    assert steps(tuner, box, 3, kind="batch") == [2] * 3


def test_a_burst_that_has_just_ended_does_not_lower_a_prefills_count():
    # Recorded on two cores right after llama-server streamed its last token: 3-4 other tasks runnable at once, 1-2
    # after 2 ms, none after 6 ms.
    box = FormulaMachine(cpus=2)
    tuner = ThreadTuner(2, probe=box)
    steps(tuner, box, 50)
    box.others = 2.0
    box.idle(9.0)  # the other server's prompt and answer, both cores
    box.others = 0.0
    box.lingering = [4, 2, 1, 0]
    assert steps(tuner, box, 3, kind="batch") == [2] * 3
    assert not box.lingering
    # a load that still runs keeps the run queue full in every reading, and is met before the first step
    box.others = 1.0
    box.idle(3.0)
    assert steps(tuner, box, 3, kind="batch") == [1] * 3


def test_a_pause_is_read_when_work_comes_not_again_at_its_first_step():
    box = FormulaMachine(cpus=2)
    tuner = ThreadTuner(2, probe=box)
    steps(tuner, box, 50)
    box.idle(1.0)
    tuner.resume()  # a request came: the machine is quiet
    box.lingering = [1, 1, 1, 1, 1]  # then its admission woke the server's threads, which are no other load
    before = box.now()
    assert steps(tuner, box, 1, kind="batch") == [2]
    assert len(box.lingering) == 5 and box.now() == pytest.approx(before + 0.005)  # no re-read, no wait
    tuner.resume()  # mid-request: nothing to read
    assert len(box.lingering) == 5


def test_a_prefill_below_full_rechecks_the_window_under_way():
    box = FormulaMachine(cpus=2, others=1.0)
    tuner = ThreadTuner(2, probe=box)
    steps(tuner, box, 60)
    assert tuner.settled("decode") == 1
    box.others = 0.0
    # Decode steps of another request: under two windows, of which the first may still hold the load.
    assert steps(tuner, box, 30) == [1] * 30
    assert steps(tuner, box, 1, kind="batch") == [2]  # the window under way, short but quiet, is enough


def test_retry_reads_the_machine_before_the_next_step():
    box = FormulaMachine(cpus=2, others=1.0)  # the flash attention trial's child ran beside the first request
    tuner = ThreadTuner(2, probe=box)
    steps(tuner, box, 60)
    box.others = 0.0
    assert steps(tuner, box, 1) == [1]  # no pause, no prefill: the engine's word is needed
    tuner.retry()
    assert steps(tuner, box, 1) == [2]


def test_a_first_token_is_handed_over_only_where_the_steps_take_every_cpu():
    box = FormulaMachine(cpus=2)
    tuner = ThreadTuner(2, probe=box)
    steps(tuner, box, 10)
    before = box.now()
    tuner.hand_over()  # two threads on two CPUs: the next step waits for the token's way out
    assert box.now() == pytest.approx(before + HANDOFF_SECONDS)
    wide = FormulaMachine(cpus=4)
    tuner = ThreadTuner(2, probe=wide)
    steps(tuner, wide, 10)
    before = wide.now()
    tuner.hand_over()  # cores to spare: it goes at once
    assert wide.now() == before


def test_steady_windows_forget_an_earlier_wrong_move():
    policy = ThreadPolicy(2)
    for _ in range(3):  # up moves taken back at once, three times
        feed(policy, [at(2, elsewhere=None, share=0.6)] * 2)
        while policy.count == 1:
            policy.observe(at(1, elsewhere=None))
    feed(policy, [at(2)] * STEADY_WINDOWS)
    feed(policy, [CONTENDED_AT_2] * 2)
    assert feed(policy, [at(1), at(1)]) == [1, 2]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_budget_caps_the_count(tmp_path: Path):
    write(tmp_path / "cpu.max", "max 100000\n")
    write(tmp_path / "user.slice" / "cpu.max", "250000 100000\n")  # a parent's quota binds its children
    write(tmp_path / "user.slice" / "app" / "cpu.max", "max 100000\n")
    write(tmp_path / "user.slice" / "app" / "cpuset.cpus.effective", "0-3,6\n")
    assert cgroup_cpu_budget(tmp_path, "0::/user.slice/app\n") == 2
    write(tmp_path / "user.slice" / "app" / "cpuset.cpus.effective", "5\n")
    assert cgroup_cpu_budget(tmp_path, "0::/user.slice/app\n") == 1
    write(tmp_path / "user.slice" / "cpu.max", "50000 100000\n")  # half a core: still one thread
    write(tmp_path / "user.slice" / "app" / "cpuset.cpus.effective", "\n")
    assert cgroup_cpu_budget(tmp_path, "0::/user.slice/app\n") == 1
    assert cgroup_cpu_budget(tmp_path / "missing", "0::/\n") is None


def test_a_cgroup_v1_budget_caps_the_count(tmp_path: Path):
    write(tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    membership = "4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n0::/\n"
    assert cgroup_cpu_budget(tmp_path, membership) == 3
    write(tmp_path / "cpuset" / "docker" / "abc" / "cpuset.effective_cpus", "0-1\n")
    assert cgroup_cpu_budget(tmp_path, membership) == 2


def test_the_budget_caps_the_tuners_first_choice(monkeypatch):
    monkeypatch.setattr(machine_facts, "cgroup_cpu_budget", lambda: 1)
    assert physical_cores() == 1
    assert ThreadTuner(physical_cores(), probe=FormulaMachine(cpus=2)).choose("batch") == 1


def test_the_linux_probe_reads_only_this_processs_cpus(tmp_path: Path):
    from localllm.engine.threads import LinuxProbe

    allowed = sorted(os.sched_getaffinity(0))
    lines = ["cpu  900 0 900 900 0 0 0 0 0 0"]
    lines += [f"cpu{c} 100 0 50 1000 30 0 0 10 0 0" for c in allowed]
    lines += ["cpu999 5000 0 0 0 0 0 0 0 0 0", "procs_running 3"]
    write(tmp_path / "stat", "\n".join(lines) + "\n")
    write(tmp_path / "loadavg", "0.50 0.40 0.30 3/200 12345\n")
    probe = LinuxProbe(tmp_path)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert probe.busy() == pytest.approx(160 * len(allowed) * tick)  # user, system and steal; not idle nor iowait
    assert probe.runnable() == 3 and probe.cpus() == len(allowed)


@pytest.mark.models
def test_an_engine_told_the_machine_changed_reads_it_again(smollm2_path):
    from localllm.api import LoadOptions, SamplingOptions
    from localllm.backends.llama_cpp.backend import LlamaCppBackend
    from localllm.engine.runner import GenerationParams, ModelEngine
    from localllm.engine.threads import LinuxProbe

    class Counting(LinuxProbe):
        reads = 0

        def runnable(self) -> int | None:
            Counting.reads += 1  # read only where the machine is looked at afresh
            return super().runnable()

    tuner = ThreadTuner(2, probe=Counting())
    model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_ctx=256, num_parallel=1))
    engine = ModelEngine(model, max_queue=1, threads=tuner)
    sampling = SamplingOptions(temperature=0, num_predict=30, ignore_eos=True, spec_type="none")

    def generate() -> None:
        list(engine.submit(GenerationParams(engine.tokenize("Once upon a time"), sampling)))

    try:
        generate()
        before = Counting.reads
        engine.machine_changed()
        generate()
        assert Counting.reads > before
    finally:
        engine.close()


@pytest.mark.models
def test_the_engine_hands_over_each_requests_first_token_once(smollm2_path):
    from localllm.api import LoadOptions, SamplingOptions
    from localllm.backends.llama_cpp.backend import LlamaCppBackend
    from localllm.engine.runner import GenerationParams, ModelEngine

    class Counting(ThreadTuner):
        handed = 0

        def hand_over(self) -> None:
            Counting.handed += 1

    model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_ctx=512, num_parallel=2))
    engine = ModelEngine(model, max_queue=2, threads=Counting(2))
    sampling = SamplingOptions(temperature=0, num_predict=20, ignore_eos=True, spec_type="none")
    try:
        streams = engine.submit_all([GenerationParams(engine.tokenize(t), sampling) for t in ("Once upon", "Hello")])
        answers = [list(stream) for stream in streams]
        assert all(sum(len(chunk.tokens) for chunk in answer) == 20 for answer in answers)
        assert 1 <= Counting.handed <= 2  # once a step that starts answers (both may start in one), not a token
    finally:
        engine.close()


def test_physical_cores_count_hyperthread_siblings_once(tmp_path: Path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert _linux_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert _linux_cores({0, 2}, tmp_path) == 1  # two siblings of one core
    assert _linux_cores({0, 9}, tmp_path) == 0  # unreadable topology: the caller falls back


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
