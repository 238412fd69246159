"""The load probe: weights that have not yet loaded on this machine are first loaded in a short-lived child process.

llama.cpp stops the whole process on a failed GGML_ASSERT (a hyperparameter out of range, a tensor type a kernel
cannot take), and no Python code can catch that. So the first load of a weights file runs in a child (load, then
one decode of a few tokens and one of a single token, the two paths a model takes): if the child dies, only that
request fails, with the assert's own line in its error, and the server lives on. A success is remembered per blob,
so each file pays the probe once per LOCALLLM_HOME and llama.cpp version (seconds; the weights stay in the page
cache for the real load that follows). A catalog file needs no child: its pinned bytes load and decode under the
llama-cpp-python the catalog was checked with (catalog.CHECKED_WITH_LLAMA_CPP), so that verdict ships with it.

The flash attention trial (flash_trial.py) runs where the choice is open and the CPU runs the model, never on the
request path: a second child, started in the background after a success; its finding is remembered with the
success and applies from the next load (`check` returns it).

A model with LoRA adapters is probed as a pair: its first load with those adapters applied runs in the child too (a
lora_a whose shape passes llama.cpp's checks can still abort the first multiplication).

Memory: `<store root>/probes/<blob digest>` (a file path outside the store is named by its path, size and mtime;
with adapters, `<weights key>+<hash of the adapters' keys>`), holding the llama.cpp and probe versions that passed
and the trial. This is the llama.cpp backend's load check (checked.py, Backend.check); MLX raises Python errors and
checks nothing.

Run as a module, this file is the child: `python -m localllm.backends.llama_cpp.probe WEIGHTS` with the LoadOptions
as JSON on stdin; its exit status says how it went (EXIT_REFUSED and its neighbours below)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ... import api
from ...errors import LocalLLMError, ModelFormatError
from ...models import catalog
from . import flash_trial
from .flash_trial import FlashTrial

log = logging.getLogger(__name__)

PROBE_VERSION = "2"  # raise when the probe checks more: what it remembered no longer covers it
PROBE_CTX = 256  # context of the child's one slot: enough for the probe's tokens, cheap to allocate
PROBE_TOKENS = 4  # decoded together first (the prompt path), then one more alone (the generation path)
# Tokenized and detokenized by the child: ASCII, controls, several scripts and an emoji, as users type them.
PROBE_TEXT = 'Hello, world!\n\t{"a": [1, 2.5]} <b>x</b> Grüße, ça va? Привет Ωμέγα 中文 日本語 한국어 🙂\r\n'
# The child's exit status: 0 loaded and decoded; EXIT_REFUSED a clean LocalLLMError (the in-process load will say
# the same); EXIT_PYTHON_ERROR an uncaught Python error. Anything else is a death: a signal on POSIX, an abort's 3 or
# an exception code on Windows.
EXIT_REFUSED = 10
EXIT_PYTHON_ERROR = 1
TRIAL_FLAG = "--trial"  # the child runs only the flash attention trial, for weights already probed
_DIGEST_NAME = re.compile(r"^sha256-[0-9a-f]{64}$")
_STDERR_TAIL = 8192
# ggml's abort message: "<source file>:<line>: <what failed>" (llama.cpp's log lines may run into it unbroken).
_GGML_MESSAGE = re.compile(r"([\w.+-]+\.(?:c|cc|cpp|h|cu|m):\d+: [^\n]*)")
# What the C++ runtime prints when an exception escapes llama.cpp's C API (std::terminate, then abort).
_UNCAUGHT = re.compile(r"instance of '([^']+)'\s+what\(\):\s*([^\n]*)")


@dataclass(frozen=True)
class Probed:
    """What the probe learned about the weights on this machine, beyond "they load"."""

    trial: FlashTrial | None = None
    trial_due: bool = False  # the flash attention trial should run (start_trial), once the weights have loaded

    def flash_attn_for(self, load: api.LoadOptions) -> bool | None:
        """The setting the trial found faster, where `load` leaves it open; None where it settles nothing."""
        return self.trial.flash_attn if self.trial is not None and flash_trial.wanted(load) else None

    def applied_to(self, load: api.LoadOptions) -> api.LoadOptions:
        """`load` with flash attention set as the trial found faster, where `load` leaves it open."""
        found = self.flash_attn_for(load)
        return load if found is None else load.model_copy(update={"flash_attn": found})


class LoadProbe:
    """Probes weights once per home before the pool loads them in-process."""

    def __init__(self, memory_dir: Path):
        self.memory_dir = Path(memory_dir)

    def check(self, weights: Path, load: api.LoadOptions, *, adapters: Sequence[api.LoraAdapter] = ()) -> Probed:
        """Return what was learned when `weights` (with `adapters` applied) loaded, now or before, in a child; raise
        ModelFormatError when the child died.

        A child that failed cleanly (a missing tensor, a context too large) is not remembered and not raised: the
        in-process load that follows fails the same way, with its own error type and status."""
        weights = Path(weights)
        files = [Path(adapter.path) for adapter in adapters]
        if not all(f.is_file() for f in [weights, *files]):  # a missing file (or an MLX folder): the real load's error
            return Probed()
        if files:  # the weights alone first: their own probe runs the flash trial, which the pair's does not
            own = self.check(weights, load)
            self._check_once(weights, load, files)
            return own
        return self._check_once(weights, load, [])

    def _check_once(self, weights: Path, load: api.LoadOptions, files: list[Path]) -> Probed:
        entry = self.memory_dir / pair_key(weights, files)
        trial = flash_trial.wanted(load) and not files  # the weights' own probe runs the trial, a pair's does not
        remembered = _recall(entry)
        if remembered is not None:
            return Probed(trial=remembered.trial, trial_due=trial and remembered.trial_due)
        if not files and _shipped(weights):
            log.info("first load of %s on this machine: a catalog file, checked with this llama.cpp", weights.name)
        else:
            log.info("first load of %s on this machine: trying it in a child process", weights.name)
            outcome = _run_child(weights, load, files)
            if outcome.returncode != 0:
                return _failed(weights, files, outcome)
        _remember(entry, Probed(), tried=not trial)
        return Probed(trial_due=trial)


def start_trial(memory_dir: Path, weights: Path, load: api.LoadOptions, done: Callable[[], None] | None = None) -> None:
    """Begin the flash attention trial a check found due for `weights`, in a child of its own in the background; its
    finding is remembered for the next load, and `done` is called when it ends. Called once the weights have loaded,
    so it never slows that load."""
    _start_trial(Path(weights), load, Path(memory_dir) / weights_key(Path(weights)), done)


def _failed(weights: Path, files: Sequence[Path], outcome: subprocess.CompletedProcess) -> Probed:
    """Raise ModelFormatError for a child that died; nothing is known from one that failed cleanly."""
    if outcome.returncode == EXIT_PYTHON_ERROR:  # not llama.cpp: the child itself could not run
        log.warning("the load probe of %s could not run: %s", weights.name, outcome.stderr[-_STDERR_TAIL:])
    elif outcome.returncode != EXIT_REFUSED:
        log.warning("%s crashed llama.cpp in the load probe: %s", weights, outcome.stderr[-_STDERR_TAIL:])
        what = f"{weights} with its LoRA adapters" if files else str(weights)
        raise ModelFormatError(
            f"{what} crashed llama.cpp while loading: {_crash_line(outcome)}",
            hint="the file is damaged or needs another llama.cpp; only this load failed",
        )
    return Probed()


def _shipped(weights: Path) -> bool:
    """Whether `weights` is a catalog file and this is the llama-cpp-python its verdict was checked with."""
    pinned = {entry.digest for entry in catalog.CATALOG}
    return weights.name in pinned and _llama_cpp_version() == catalog.CHECKED_WITH_LLAMA_CPP


_trials_lock = threading.Lock()
_trials: dict[Path, threading.Thread] = {}  # background trials of this process, by memory entry


def _start_trial(weights: Path, load: api.LoadOptions, entry: Path, done: Callable[[], None] | None) -> None:
    """Run the flash attention trial in a child of its own, off the request path; its finding is remembered for
    the next load. One trial per entry and process at a time."""
    with _trials_lock:
        running = _trials.get(entry)
        if running is not None and running.is_alive():
            return
        thread = threading.Thread(
            target=_trial_child, args=(weights, load, entry, done), name="localllm-trial", daemon=True
        )
        _trials[entry] = thread
        thread.start()


def wait_for_trials(timeout: float | None = None) -> None:
    """Wait for the background trials this process started (tests; a benchmark that wants the next load tuned)."""
    with _trials_lock:
        threads = list(_trials.values())
    for thread in threads:
        thread.join(timeout)


def _trial_child(weights: Path, load: api.LoadOptions, entry: Path, done: Callable[[], None] | None) -> None:
    try:
        _run_trial(weights, load, entry)
    finally:
        if done is not None:
            done()


def _run_trial(weights: Path, load: api.LoadOptions, entry: Path) -> None:
    try:
        outcome = _run_child(weights, load, trial=True)
    except ModelFormatError as exc:  # too slow: llama.cpp's choice stays
        log.warning("flash attention trial of %s: %s", weights.name, exc)
        outcome = None
    trial = _reported_trial(outcome.stdout) if outcome is not None and outcome.returncode == 0 else None
    if outcome is not None and outcome.returncode != 0:
        log.warning("flash attention trial of %s failed: %s", weights.name, outcome.stderr[-_STDERR_TAIL:])
    if trial is not None:
        log.info("%s on this CPU, %s (from its next load)", weights.name, trial.describe())
    if _recall(entry) is not None:  # still a success of this llama.cpp: add what the trial found
        _remember(entry, Probed(trial=trial), tried=True)


def weights_key(weights: Path) -> str:
    """A store blob is named by its digest; any other file by its path, size and modification time."""
    weights = Path(weights)
    if _DIGEST_NAME.match(weights.name):
        return weights.name
    stat = weights.stat()
    identity = f"{weights.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return f"file-{hashlib.sha256(identity).hexdigest()}"


def pair_key(weights: Path, adapters: Sequence[Path]) -> str:
    """The memory's name for weights with adapters applied (the weights' own key without any)."""
    if not adapters:
        return weights_key(weights)
    joined = "\0".join(weights_key(adapter) for adapter in adapters)
    return f"{weights_key(weights)}+{hashlib.sha256(joined.encode()).hexdigest()[:32]}"


def _llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "unknown"


def _record() -> dict[str, str]:
    """What a success is remembered with: another llama.cpp, or another probe, proves nothing about this one."""
    return {"llama_cpp": _llama_cpp_version(), "probe": PROBE_VERSION}


def _recall(entry: Path) -> Probed | None:
    """What a success under this llama.cpp and probe remembered, its trial due where none has run yet (a memory
    written before trials ran in the background has its trial with it); None when there is none to trust."""
    try:
        memory = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(memory, dict) or {key: memory.get(key) for key in _record()} != _record():
        return None
    tried = bool(memory.get("trial_done", "flash_trial" in memory))
    return Probed(trial=FlashTrial.from_json(memory.get("flash_trial")), trial_due=not tried)


def trial_pending(entry: Path) -> bool:
    """Whether the memory at `entry` is one this llama.cpp trusts whose flash attention trial has not ended yet."""
    recalled = _recall(entry)
    return recalled is not None and recalled.trial_due


def _remember(entry: Path, probed: Probed, *, tried: bool) -> None:
    memory = {**_record(), "flash_trial": probed.trial.to_json() if probed.trial else None, "trial_done": tried}
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        temp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}")
        temp.write_text(json.dumps(memory), encoding="utf-8")
        os.replace(temp, entry)
    except OSError as exc:  # a read-only home: the probe runs again next time, nothing worse
        log.warning("could not remember that %s loads: %s", entry.name, exc)


def _timeout(weights: Path) -> float:
    # Loading reads the whole file once; allow a slow disk (about 30 MB/s) on top of a minute of fixed cost.
    return 60.0 + Path(weights).stat().st_size / 30e6


def _run_child(
    weights: Path, load: api.LoadOptions, adapters: Sequence[Path] = (), *, trial: bool = False
) -> subprocess.CompletedProcess:
    """The probe's child (`trial`: the flash attention trial's) on `weights` with `adapters`, to its end."""
    options = load.model_copy(
        update={
            "num_ctx": PROBE_CTX,
            "num_parallel": 1,
            "draft": None,
            "embedding": False,
            "num_batch": max(load.num_batch, PROBE_TOKENS),
        }
    )
    # No backtrace: ggml would otherwise try to attach a debugger to the dying child.
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    flag = [TRIAL_FLAG] if trial else []
    command = [sys.executable, "-m", "localllm.backends.llama_cpp.probe", *flag, str(weights), *map(str, adapters)]
    try:
        return subprocess.run(
            command,
            input=options.model_dump_json(),
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            timeout=_timeout(weights),
        )
    except subprocess.TimeoutExpired:
        raise ModelFormatError(
            f"{weights} did not load within {_timeout(weights):.0f} s in the load probe",
            hint="the file may be damaged; only this load failed",
        ) from None


def _reported_trial(stdout: str) -> FlashTrial | None:
    """The trial the child printed as its last line (nothing when it ran none)."""
    lines = stdout.strip().splitlines()
    try:
        return FlashTrial.from_json(json.loads(lines[-1])) if lines else None
    except ValueError:
        return None


def _crash_line(outcome: subprocess.CompletedProcess) -> str:
    """Why the child died: ggml's "file.cpp:line: message" (GGML_ASSERT, GGML_ABORT), a C++ exception that escaped
    llama.cpp, else the signal."""
    tail = outcome.stderr[-_STDERR_TAIL:]
    found = _GGML_MESSAGE.findall(tail)
    if found:
        return found[-1].strip()[:300]
    thrown = _UNCAUGHT.search(tail)
    if thrown:
        return f"llama.cpp threw {thrown.group(1)} ({thrown.group(2).strip()[:200]})"
    if outcome.returncode < 0:
        try:
            return f"the load probe was killed by {signal.Signals(-outcome.returncode).name}"
        except ValueError:
            pass
    return f"the load probe ended with status {outcome.returncode}"


# ---------------------------------------------------------------------------------------------------------- child


def _probe_tokens(n_vocab: int, bos: int | None) -> list[int]:
    first = bos if bos is not None else 0
    return [first] + [token % n_vocab for token in range(1, PROBE_TOKENS)]


def probe_load(weights: Path, load: api.LoadOptions, adapters: Sequence[Path] = ()) -> None:
    """Load `weights` (with `adapters` at scale 1, so that they take part in every multiplication), tokenize text
    of several scripts and decode a few tokens, then one more: what the child runs."""
    from ..base import Batch
    from .backend import LlamaCppBackend

    loras = [api.LoraAdapter(path=str(path)) for path in adapters]
    model = LlamaCppBackend().load(
        weights, load.model_copy(update={"num_ctx": PROBE_CTX, "num_parallel": 1}), adapters=loras
    )
    try:
        for token in model.tokenize(PROBE_TEXT):  # a vocabulary without byte fallback aborts on unknown text
            model.token_bytes(token)
        tokens = _probe_tokens(model.meta.n_vocab, model.meta.bos_token)
        prompt = Batch()
        for pos, token in enumerate(tokens):
            prompt.add(token, pos, 0, pos == len(tokens) - 1)
        model.decode(prompt)
        model.logits(len(tokens) - 1)
        one = Batch()
        one.add(tokens[-1], len(tokens), 0, True)
        model.decode(one)
        model.logits(0)
    finally:
        model.close()


def _main(argv: list[str]) -> int:
    load = api.LoadOptions.model_validate_json(sys.stdin.read())
    if argv[0] == TRIAL_FLAG:
        trial = _flash_trial(Path(argv[1]), load)
        print(json.dumps(trial.to_json() if trial else None), flush=True)
        return 0
    weights, adapters = Path(argv[0]), [Path(arg) for arg in argv[1:]]
    try:
        probe_load(weights, load, adapters)
    except LocalLLMError as exc:
        print(exc, flush=True)
        return EXIT_REFUSED
    return 0


def _flash_trial(weights: Path, load: api.LoadOptions) -> FlashTrial | None:
    if not flash_trial.wanted(load):
        return None
    try:
        return flash_trial.run_trial(weights, load)
    except LocalLLMError as exc:  # the weights load: only the choice stays llama.cpp's
        print(f"flash attention trial failed: {exc}", file=sys.stderr, flush=True)
        return None


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
