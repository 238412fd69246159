"""The model pool: loads models on first use, keeps them for keep_alive, evicts the least recently used idle one
when LOCALLLM_MAX_LOADED_MODELS is reached, and reloads a model whose load options change.

A request that needs a model loaded, reloaded with other load options, or room made for it waits in the pool's
queue, as Ollama's scheduler makes it wait: the models in its way take no new requests, finish the running ones and
unload, and then it loads. Waiting requests are served in arrival order: the oldest one that no loaded model can
serve (the head) decides which models must go, and those take no new requests until it has loaded, so no model or
option set starves under churn; meanwhile every waiting request a loaded model can serve (the head's own group, once
it has loaded) goes at once. The queue holds LOCALLLM_MAX_QUEUE requests (beyond that an immediate QueueFull, 503)
and each waits at most LOCALLLM_LOAD_TIMEOUT.

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
from ..errors import Cancelled, ModelFormatError, ModelNotFound, QueueFull
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
    draining: bool = False  # a waiting request needs it gone: it takes no new requests and unloads once idle
    waiting: int = 0  # requests for this model waiting in the pool's queue (for a reload with their options)

    @property
    def key(self) -> str:
        return self.model.digest


@dataclass(eq=False)
class _Ticket:
    """A request waiting in the pool's queue for its model with its load options."""

    model: ResolvedModel
    load: api.LoadOptions
    since: float = field(default_factory=time.monotonic)
    granted: Loaded | None = None  # the loaded model it may use (its user count already taken)
    may_load: bool = False  # the head, with nothing left in its way: its thread loads
    loading: bool = False


class ModelPool:
    def __init__(self, store: Store | None = None, *, speculation_factory: SpeculationFactory | None = None):
        self.store = store or Store()
        self._loaded: dict[str, Loaded] = {}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a model loaded, was released or unloaded
        self._queue: list[_Ticket] = []  # arrival order
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
        ticket = _Ticket(model, load)
        with self._changed:
            self._queue.append(ticket)
            try:
                self._dispatch()
                self._check_queue_room(ticket)
                self._wait_for_turn(ticket)
            except BaseException:
                self._leave(ticket)
                raise
            if ticket.granted is not None:
                self._queue.remove(ticket)
                return ticket.granted
            ticket.loading = True
        return self._load_for(ticket, keep_alive)

    def _check_queue_room(self, ticket: _Ticket) -> None:
        """A request that must wait finds room in the queue (LOCALLLM_MAX_QUEUE) or is refused at once."""
        if ticket.granted is not None or ticket.may_load:
            return
        limit = config.MAX_QUEUE.get()
        if sum(t.granted is None for t in self._queue) > limit:
            raise QueueFull(
                f"{limit} requests are already waiting for models to load or reload (LOCALLLM_MAX_QUEUE={limit})",
                hint="retry shortly, or raise LOCALLLM_MAX_QUEUE",
            )

    def _wait_for_turn(self, ticket: _Ticket) -> None:
        """Wait (the lock released meanwhile) until a loaded model serves `ticket` or it may load; at most
        LOCALLLM_LOAD_TIMEOUT."""
        timeout = config.LOAD_TIMEOUT.get()
        while ticket.granted is None and not ticket.may_load:
            if self._stopping.is_set():
                raise Cancelled("the server is shutting down")
            left = ticket.since + timeout - time.monotonic()
            if left <= 0:
                raise QueueFull(
                    f"{ticket.model.name} waited {timeout:g}s for a turn to load: {self._blocking(ticket)}",
                    hint="retry later, send the load options the running requests use, or raise "
                    "LOCALLLM_LOAD_TIMEOUT / LOCALLLM_MAX_LOADED_MODELS",
                )
            self._changed.wait(left)
            self._dispatch()

    def _blocking(self, ticket: _Ticket) -> str:
        """What a request that timed out was waiting for, in words."""
        going = [e.model.name for e in self._loaded.values() if e.draining]
        if going:
            return f"{', '.join(going)} still running requests before unloading"
        return f"{sum(t.granted is None for t in self._queue[: self._queue.index(ticket)])} requests ahead of it"

    def _leave(self, ticket: _Ticket) -> None:
        """`ticket` gives up (timed out, refused, failed to load): its place and any model it was given go back."""
        if ticket in self._queue:
            self._queue.remove(ticket)
        if ticket.granted is not None:
            self._release(ticket.granted, None)
            ticket.granted = None
        self._dispatch()
        self._changed.notify_all()

    def _load_for(self, ticket: _Ticket, keep_alive: float | None) -> Loaded:
        """Load `ticket`'s model (the lock not held: other models serve meanwhile) and serve it the entry."""
        try:
            entry = self._load(ticket.model, ticket.load, keep_alive)
        except BaseException:
            with self._changed:
                self._leave(ticket)
            raise
        with self._changed:
            self._loaded[entry.key] = entry
            self._take(entry, ticket)
            self._queue.remove(ticket)
            self._dispatch()  # the requests waiting for the same model and options go with it
            self._changed.notify_all()
        return entry

    def _dispatch(self) -> None:
        """Serve the queue (the lock held): every waiting request a loaded model can serve takes it, except models
        the head (the oldest request no loaded model serves) needs gone; those unload once idle, and then the head
        may load."""
        while True:
            head = next((t for t in self._queue if t.granted is None), None)
            going = self._in_way(head)
            for entry in self._loaded.values():
                entry.draining = entry in going
            served = [t for t in self._queue if t.granted is None and not t.loading and self._serve(t)]
            if head is None or head not in served:
                break
        for entry in self._loaded.values():
            entry.waiting = sum(t.granted is None and t.model.digest == entry.key for t in self._queue)
        if head is None or head.loading or head.may_load:
            return
        for entry in going:
            if entry.users == 0:
                self._unload(entry)
        head.may_load = all(self._loaded.get(entry.key) is not entry for entry in going)

    def _in_way(self, head: _Ticket | None) -> list[Loaded]:
        """The loaded models that must go before `head` can load: its own under other options, and while the pool is
        full (LOCALLLM_MAX_LOADED_MODELS) the least wanted others: idle first, then the fewest users, the least
        recently used. A draining model gets no new requests, so its users only fall."""
        if head is None or head.loading or head.may_load:
            return []
        own = self._loaded.get(head.model.digest)
        if own is not None and not self._needs_reload(own, head.load):
            return []  # it serves the head
        others = [e for e in self._loaded.values() if e is not own]
        excess = len(others) + 1 - config.MAX_LOADED_MODELS.get()
        victims = sorted(others, key=lambda e: (e.users > 0, e.users, e.last_used))[: max(0, excess)]
        return ([own] if own is not None else []) + victims

    def _serve(self, ticket: _Ticket) -> bool:
        """Give `ticket` its model when loaded with its options and not draining."""
        entry = self._loaded.get(ticket.model.digest)
        if entry is None or entry.draining or self._needs_reload(entry, ticket.load):
            return False
        self._take(entry, ticket)
        return True

    @staticmethod
    def _take(entry: Loaded, ticket: _Ticket) -> None:
        entry.users += 1
        entry.expires_at = None
        if entry.removed:  # the caller resolved these weights under a name that still has them
            entry.model, entry.removed = ticket.model, False
        ticket.granted = entry

    @staticmethod
    def _needs_reload(entry: Loaded, load: api.LoadOptions) -> bool:
        # A closed engine failed (say, its RPC worker went away): load again rather than queue to nobody.
        return not serves(entry.options, load) or entry.engine.closed

    def waiting(self) -> int:
        """Requests waiting in the pool's queue for a model to load, reload or make room (`ps`, /metrics)."""
        with self._lock:
            return sum(t.granted is None for t in self._queue)

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
        with self._changed:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if keep_alive is not None:
                entry.keep_alive = keep_alive
            if entry.users == 0:
                self._set_expiry(entry)
                if entry.keep_alive <= 0 or entry.removed:
                    self._unload(entry)
            self._changed.notify_all()  # a draining model may now unload for a waiting request

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
        with self._changed:
            self._changed.notify_all()

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
        with self._changed:
            self._changed.notify_all()  # requests waiting for a turn end
        for entry in self.entries():
            self._unload(entry)
