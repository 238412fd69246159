"""Embedding requests as the engine thread serves them: a batch at a time, taking turns.

One request of thousands of inputs would otherwise hold the engine thread until its last vector: a one-input request
behind it waits as long, and so does every generation step, and the work goes on after its client has left. So each
turn embeds one batch of the request at the front, which then goes to the back of the line; a request whose client
has left is dropped at its next turn."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import Cancelled

EMBED_BATCH = 64  # inputs one turn embeds at most (a packed decode holds up to 64 sequences)

Embed = Callable[[list[list[int]]], list[list[float]]]


@dataclass
class EmbedJob:
    """One request's inputs, its vectors so far, and how its caller is told (the future) or tells us it left."""

    inputs: list[list[int]]
    future: Future[list[list[float]]]
    cancelled: Callable[[], bool]
    vectors: list[list[float]] = field(default_factory=list)


class EmbedQueue:
    """The embedding requests waiting on the engine thread, served round-robin; only that thread touches it."""

    def __init__(self, n_ctx: int):
        self._jobs: deque[EmbedJob] = deque()
        self._n_ctx = n_ctx
        self.embedded = 0  # inputs embedded since the load
        self.dropped = 0  # requests dropped because their client left

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, job: EmbedJob) -> None:
        self._jobs.append(job)

    def turn(self, embed: Embed) -> None:
        """Embed the next batch of the request at the front, and answer it when that was its last."""
        job = self._jobs.popleft()
        if job.cancelled():
            self.dropped += 1
            job.future.set_exception(Cancelled("the client went away while its inputs were embedded"))
            return
        batch = self._batch(job)
        try:
            job.vectors += embed(batch)
        except BaseException as exc:  # the request fails, not the engine (as every inbox command's does)
            job.future.set_exception(exc)
            return
        self.embedded += len(batch)
        if len(job.vectors) < len(job.inputs):
            self._jobs.append(job)
        else:
            job.future.set_result(job.vectors)

    def _batch(self, job: EmbedJob) -> list[list[int]]:
        """The job's next inputs: EMBED_BATCH at most, and no more tokens than a context (one input at least)."""
        start = len(job.vectors)
        end, tokens = start, 0
        while end < len(job.inputs) and end - start < EMBED_BATCH:
            tokens += len(job.inputs[end])
            if end > start and tokens > self._n_ctx:
                break
            end += 1
        return job.inputs[start:end]

    def fail_all(self, exc: BaseException) -> None:
        while self._jobs:
            self._jobs.popleft().future.set_exception(exc)
