"""The model pool: loads models on first use, keeps them for keep_alive, evicts the least recently used idle one
when LOCALLLM_MAX_LOADED_MODELS is reached, and reloads a model whose load options change.

Load options come as models/options.resolve_options made them (the Modelfile's parameters, then the request's) and
are completed there once (load_options); `needs_reload` compares LoadOptions only (sampling options never cause a
reload). Entries are per model (its manifest: weights, adapters, parameters); models over the same weights share them
in memory through the backend (LoadedModel.weights), each entry keeping its own context and slots."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from .. import api, config
from ..backends import choose_backend, get_backend, load_check_memory, workers_back
from ..backends.base import LoadedModel
from ..errors import ModelFormatError, ModelNotFound, QueueFull
from ..machine import physical_cores
from ..models.options import check_memory, effective_adapters, load_options, model_facts, serves
from ..models.store import ResolvedModel, Store
from .prefix_cache import make_prefix_cache, sweep_unfinished
from .runner import ModelEngine
from .speculative.speculation import Speculation
from .threads import ThreadTuner

# Called once per load, on the loading thread: what the model offers for speculative decoding.
SpeculationFactory = Callable[[ResolvedModel, api.LoadOptions, LoadedModel], Speculation]

log = logging.getLogger(__name__)
WORKER_CHECK_BEATS = 10  # reaper beats (half a second each) between checks for RPC workers that are back


@dataclass(eq=False)
class Loaded:
    """One loaded model in the pool."""

    model: ResolvedModel
    options: api.LoadOptions
    engine: ModelEngine
    backend: str
    load_seconds: float
    keep_alive: float
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: datetime | None = None
    speculation: Speculation | None = None  # what the speculation factory built for this load, if any
    measured_flash_attn: bool | None = None  # chosen by the backend's load check, where the load left it open
    # No name stands for these weights any more (`rm` here or in another process, or the last alias deleted): new
    # requests get 404 from the store, and it unloads when its running requests end.
    removed: bool = False

    @property
    def key(self) -> str:
        return self.model.digest


class ModelPool:
    def __init__(self, store: Store | None = None, *, speculation_factory: SpeculationFactory | None = None):
        self.store = store or Store()
        self._loaded: dict[str, Loaded] = {}
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()
        self._speculation_factory = speculation_factory
        self._check_memory = load_check_memory(self.store.root)
        sweep_unfinished(config.prefix_cache_dir())  # writes a killed process left, whichever model they were for
        self._reaper = threading.Thread(target=self._reap_forever, name="localllm-keepalive", daemon=True)
        self._stopping = threading.Event()
        self._reaper.start()

    @contextmanager
    def acquire(
        self, model: ResolvedModel, load: api.LoadOptions, *, keep_alive: float | None = None
    ) -> Iterator[Loaded]:
        """Hold a loaded model for one request; keep_alive (seconds, inf forever) starts counting on release.
        The options are checked against the model and the machine first (models/options.py)."""
        try:
            entry = self._get_or_load(model, load_options(model, load), keep_alive)
        except ModelFormatError:
            if model.weights.exists():
                raise
            # `cp` or `create` over the name (or `rm`) collected the blob this request resolved: no internal path
            raise ModelNotFound(
                f"{model.name} was replaced or removed while this request waited for it to load",
                hint="send the request again: the name now stands for what replaced it",
            ) from None
        try:
            yield entry
        finally:
            self._release(entry, keep_alive)

    def _get_or_load(self, model: ResolvedModel, load: api.LoadOptions, keep_alive: float | None) -> Loaded:
        with self._load_lock:  # one load at a time: loading twice would double the memory
            with self._lock:
                entry = self._loaded.get(model.digest)
                if entry is not None and not self._needs_reload(entry, load):
                    entry.users += 1
                    entry.expires_at = None
                    if entry.removed:  # the caller resolved these weights under a name that still has them
                        entry.model, entry.removed = model, False
                    return entry
                if entry is not None:
                    self._unload_when_idle(entry, reason="load options changed")
                self._make_room()
            entry = self._load(model, load, keep_alive)
            with self._lock:
                entry.users += 1
                self._loaded[model.digest] = entry
            return entry

    @staticmethod
    def _needs_reload(entry: Loaded, load: api.LoadOptions) -> bool:
        # A closed engine failed (say, its RPC worker went away): load again rather than queue to nobody.
        return not serves(entry.options, load) or entry.engine.closed

    def _unload_when_idle(self, entry: Loaded, *, reason: str) -> None:
        if entry.users > 0:
            raise QueueFull(
                f"{entry.model.name} is busy with other load options ({reason})",
                hint="retry when its requests finish, or use the same options",
            )
        self._unload(entry)

    def _make_room(self) -> None:
        limit = config.MAX_LOADED_MODELS.get()
        while len(self._loaded) >= limit:
            idle = [e for e in self._loaded.values() if e.users == 0]
            if not idle:
                raise QueueFull(
                    f"all {len(self._loaded)} loaded models are busy (LOCALLLM_MAX_LOADED_MODELS={limit})",
                    hint="retry shortly or raise LOCALLLM_MAX_LOADED_MODELS",
                )
            self._unload(min(idle, key=lambda e: e.last_used))

    def _load(self, model: ResolvedModel, load: api.LoadOptions, keep_alive: float | None) -> Loaded:
        backend_name = choose_backend(load.backend, model.weights)
        check_memory(load, model_facts(model.weights, model.format), model.name)
        t0 = time.perf_counter()
        backend = get_backend(backend_name)
        adapters = effective_adapters(model, load)
        # a file (or an adapter on it) that would abort the backend fails here
        checked = backend.check(model.weights, load, memory=self._check_memory, adapters=adapters)
        # The entry keeps the options asked for (a request that asks the same again reuses it); the context gets
        # the check's findings for what was left open.
        context_load = checked.applied_to(load)
        loaded = backend.load(model.weights, context_load, adapters=adapters, projector=model.projector)
        seconds = time.perf_counter() - t0
        try:
            factory = self._speculation_factory
            speculation = factory(model, load, loaded) if factory is not None else None
            prefix_cache = make_prefix_cache(loaded, model.digest)
        except BaseException:  # e.g. a draft model with another vocabulary: the error goes to the request
            loaded.close()
            raise
        tuner = ThreadTuner(physical_cores()) if load.num_thread is None and loaded.threads is not None else None
        engine = ModelEngine(
            loaded,
            max_queue=config.MAX_QUEUE.get(),
            load_seconds=seconds,
            speculation=speculation,
            threads=tuner,
            pinned_threads=load.num_thread or 0,
            prefix_cache=prefix_cache,
        )
        checked.loaded(engine.machine_changed)  # the trial's child took CPU: the thread counts are tried again
        if speculation is not None:
            speculation.loaded(engine.machine_changed)  # the draft model's trial, likewise
        log.info(
            "loaded %s on %s in %.2fs: %d slots x %d tokens",
            model.name,
            backend_name,
            seconds,
            loaded.n_seq,
            loaded.n_ctx,
        )
        return Loaded(
            model=model,
            options=load,
            engine=engine,
            backend=backend_name,
            load_seconds=seconds,
            keep_alive=config.KEEP_ALIVE.get() if keep_alive is None else keep_alive,
            speculation=speculation,
            measured_flash_attn=checked.flash_attn,
        )

    def _release(self, entry: Loaded, keep_alive: float | None) -> None:
        with self._lock:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if keep_alive is not None:
                entry.keep_alive = keep_alive
            if entry.users == 0:
                self._set_expiry(entry)
                if entry.keep_alive <= 0 or entry.removed:
                    self._unload(entry)

    @staticmethod
    def _set_expiry(entry: Loaded) -> None:
        ka = entry.keep_alive
        try:
            entry.expires_at = None if ka == float("inf") else datetime.now(timezone.utc) + timedelta(seconds=ka)
        except OverflowError:  # past the last datetime: forever (config.parse_duration already caps durations)
            entry.expires_at = None

    def _unload(self, entry: Loaded) -> None:
        with self._lock:
            if self._loaded.get(entry.key) is entry:
                del self._loaded[entry.key]
        entry.engine.close()
        log.info("unloaded %s", entry.model.name)

    def unload(self, name_or_digest: str) -> bool:
        """Unload now (`localllm stop`); False when it was not loaded."""
        with self._lock:
            matches = [e for e in self._loaded.values() if name_or_digest in (e.model.name, e.model.digest)]
        for entry in matches:
            self._unload(entry)
        return bool(matches)

    def retire(self, digest: str) -> None:
        """The last name of model `digest` is gone: unload it now if idle, else when its running requests end
        (deleting a name never cuts off requests made under it or another name)."""
        with self._lock:
            entry = self._loaded.get(digest)
            if entry is None:
                return
            if entry.users > 0:
                entry.removed = True
                return
        self._unload(entry)

    def entries(self) -> list[Loaded]:
        self._notice_removals()
        with self._lock:
            return list(self._loaded.values())

    def _notice_removals(self) -> None:
        """Mark models whose name another process removed or replaced (`localllm rm` beside the server); new
        requests already get 404 from the store, and each unloads once its running requests end."""
        for entry in self._all():
            if entry.removed or self.store.still_names(entry.model.name, entry.model.digest):
                continue
            with self._lock:
                entry.removed = True
                idle = entry.users == 0
            if idle:
                self._unload(entry)

    def _all(self) -> list[Loaded]:
        with self._lock:
            return list(self._loaded.values())

    def sharing_weights(self, entry: Loaded) -> list[str]:
        """Names of the other loaded models that use `entry`'s weights in memory (`ps`)."""
        mine = entry.engine.model.weights
        return sorted(
            other.model.name for other in self.entries() if other is not entry and other.engine.model.weights == mine
        )

    def _reap_forever(self) -> None:
        beats = 0
        while not self._stopping.wait(0.5):
            beats += 1
            self._notice_removals()
            if beats % WORKER_CHECK_BEATS == 0:
                self._unload_where_workers_are_back()
            now = datetime.now(timezone.utc)
            with self._lock:
                expired = [
                    e
                    for e in self._loaded.values()
                    if e.users == 0 and e.expires_at is not None and e.expires_at <= now
                ]
            for entry in expired:
                self._unload(entry)

    def _unload_where_workers_are_back(self) -> None:
        """An idle model that runs on this machine alone because its RPC workers were gone at load is unloaded once
        they answer again: its next request loads it with them."""
        with self._lock:
            candidates = [
                (e, p.missing_workers) for e in self._loaded.values() if (p := e.engine.placement) and p.missing_workers
            ]
        for entry, missing in candidates:
            if entry.users > 0 or not workers_back(missing):
                continue
            log.info(
                "the RPC worker(s) at %s answer again: %s loads with them next", ", ".join(missing), entry.model.name
            )
            with self._lock:  # held across the unload: no request takes it meanwhile
                if entry.users == 0:
                    self._unload(entry)

    def close(self) -> None:
        self._stopping.set()
        for entry in self.entries():
            self._unload(entry)
