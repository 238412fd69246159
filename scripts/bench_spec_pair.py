"""The draft-pair section of scripts/bench.py: a real target drafted by a real smaller model of its family
(qwen2.5-coder:1.5b by qwen2.5-coder:0.5b), single stream, greedy, on a code edit and a chat prompt.

    draft vs off            ours with the draft model against ours without speculation
    n-gram vs off           ours with prompt lookup against ours without (code edit)
    vs llama-server         llama.cpp's own server at its defaults (`-m TARGET`, plus `-md DRAFT` or `--spec-type
                            ngram-simple`), fed the same prompt tokens
    4 busy slots            four code edits at once, speculation auto (the draft model) against off

Rates are the client's clock for both servers: tokens after the first one over the time from the first to the last
chunk, streamed. Each single-stream figure is the best of interleaved repeats (ours and llama-server alternate, so
load from elsewhere hits both). Beside each figure: the acceptance per draft position and where the drafting
request's time went (draft, verify, sample), from the engine's own counters."""

from __future__ import annotations

import time
from pathlib import Path

from bench_spec import LlamaServer, _same, edit_request

from localllm.api import LoadOptions, SamplingOptions
from localllm.backends.llama_cpp.backend import LlamaCppBackend
from localllm.bench.engine import user_turn_tokens
from localllm.bench.figures import Bracketed, Figure
from localllm.engine.runner import GenerationParams, ModelEngine
from localllm.engine.speculative.speculation import Speculation, open_draft_model
from localllm.machine import physical_cores

CHAT = "Explain what a Python decorator is and when to use one, with a short example."
N_CTX = 4096


class PairEngine:
    """Our engine over the target with the draft model beside it, as a Modelfile's DRAFT line loads it."""

    def __init__(self, target: Path, draft: Path, *, threads: int, slots: int):
        load = LoadOptions(num_thread=threads, num_ctx=N_CTX, num_parallel=slots)
        model = LlamaCppBackend().load(target, load)
        self.speculation = Speculation(model, draft=open_draft_model(draft, load, model, name=draft.name))
        self.engine = ModelEngine(model, max_queue=16, speculation=self.speculation)

    def chat_tokens(self, content: str) -> list[int]:
        return user_turn_tokens(self.engine, content)

    def stream(self, prompt: list[int], n: int, spec_type: str) -> tuple[float, list[int], object]:
        """(the client's rate, the tokens, the final timings) of one streamed greedy answer."""
        opts = SamplingOptions(temperature=0, num_predict=n, spec_type=spec_type)
        clock = _Clock()
        timings = None
        for chunk in self.engine.submit(GenerationParams(prompt, opts)):
            clock.received(list(chunk.tokens))
            timings = chunk.timings or timings
        return clock.rate(), clock.tokens, timings

    def run_all(self, prompts: list[list[int]], n: int, spec_type: str) -> tuple[float, list[list[int]]]:
        """Aggregate tokens per second of several answers submitted in one step."""
        opts = SamplingOptions(temperature=0, num_predict=n, spec_type=spec_type)
        t0 = time.perf_counter()
        streams = self.engine.submit_all([GenerationParams(p, opts) for p in prompts])
        outputs = [[t for chunk in stream for t in chunk.tokens] for stream in streams]
        return sum(map(len, outputs)) / (time.perf_counter() - t0), outputs

    def close(self) -> None:
        self.engine.close()


class _Clock:
    """Tokens as they arrive, and the rate after the first one."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first = self.last = 0.0
        self.n_first = 0  # tokens in the first chunk: the rate counts those after it

    def received(self, tokens: list[int]) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if not self.tokens:
            self.first, self.n_first = now, len(tokens)
        self.last = now
        self.tokens += tokens

    def rate(self) -> float:
        after = len(self.tokens) - self.n_first
        return after / (self.last - self.first) if self.last > self.first else 0.0


def _server_stream(server: LlamaServer, prompt: list[int], n: int) -> tuple[float, list[int]]:
    clock = _Clock()
    server.stream(prompt, n, clock.received)
    return clock.rate(), clock.tokens


def _acceptance_note(before: tuple[list[int], list[int]], engine: ModelEngine) -> str:
    """Acceptance per draft position over the runs since `before` (the engine's counters then)."""
    stats = engine.snapshot()
    verified = [a - b for a, b in zip(stats.verified_at, before[0])]
    accepted = [a - b for a, b in zip(stats.accepted_at, before[1])]
    shown = [f"{h / v:.2f}" for h, v in zip(accepted[:8], verified[:8]) if v]
    return "acceptance by position " + (" ".join(shown) if shown else "(nothing drafted)")


def _split_note(timings) -> str:
    if timings is None or not timings.draft_count:
        return "nothing drafted"
    total = timings.eval_duration or 1
    parts = {"draft": timings.draft_duration, "verify": timings.verify_duration, "sample": timings.sample_duration}
    split = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items())
    return f"{timings.draft_accepted}/{timings.draft_count} accepted, time: {split} of the answer"


def pair_figures(
    target: Path, draft: Path, *, n: int, repeats: int, llama_server: str | None, log=print
) -> list[Figure]:
    threads = physical_cores()  # llama-server's default too: the same threads on both sides
    figures = _single_stream(target, draft, n=n, threads=threads, repeats=repeats, llama_server=llama_server, log=log)
    figures.append(_busy(target, draft, n=n // 2, threads=threads, log=log))
    return figures


def _single_stream(
    target: Path, draft: Path, *, n: int, threads: int, repeats: int, llama_server: str | None, log
) -> list[Figure]:
    ours = PairEngine(target, draft, threads=threads, slots=1)
    servers: dict[str, LlamaServer] = {}
    best: dict[tuple[str, str], tuple] = {}
    notes: dict[tuple[str, str], str] = {}

    def keep(key: tuple[str, str], rate: float, tokens: list[int], note: str = "") -> None:
        if rate > best.get(key, (0.0,))[0]:
            best[key] = (rate, tokens)
            notes[key] = note

    try:
        prompts = {"code edit": ours.chat_tokens(edit_request()), "chat": ours.chat_tokens(CHAT)}
        if llama_server:
            log("starting llama-server at its defaults: plain, -md, --spec-type ngram-simple")
            servers = {
                "off": LlamaServer(llama_server, target, threads=threads, spec=None, defaults=True),
                "draft": _draft_server(llama_server, target, draft),
                "ngram": LlamaServer(llama_server, target, threads=threads, spec="ngram-simple", defaults=True),
            }
        for prompt in prompts.values():  # warm every slot's prefix, so each measured run starts alike
            ours.stream(prompt, 4, "none")
            for server in servers.values():
                _server_stream(server, prompt, 4)
        for i in range(repeats):
            for task, prompt in prompts.items():
                log(f"{task}, 1 slot: repeat {i + 1}/{repeats}")
                for spec_type in ("none", "draft", "ngram") if task == "code edit" else ("none", "draft"):
                    stats = ours.engine.snapshot()
                    counters = (list(stats.verified_at), list(stats.accepted_at))
                    rate, tokens, timings = ours.stream(prompt, n, spec_type)
                    note = f"{_acceptance_note(counters, ours.engine)}; {_split_note(timings)}"
                    keep((task, spec_type), rate, tokens, note)
                for name, server in servers.items():
                    if name == "ngram" and task != "code edit":
                        continue
                    rate, tokens = _server_stream(server, prompt, n)
                    keep((task, "server-" + name), rate, tokens)
        cost = ours.speculation.cost.describe()
        draft_ms = ours.speculation.draft_model.seconds_per_token * 1e3 if ours.speculation.draft_model else 0.0
    finally:
        for server in servers.values():
            server.close()
        ours.close()
    why = f"a target step costs {cost} (engine CPU), a draft token {draft_ms:.1f} ms; {threads} threads"
    figures = []
    for task, target_gain in (("code edit", 1.5), ("chat", 1.0)):
        off, on = best[(task, "none")], best[(task, "draft")]
        figures.append(
            Figure(
                f"{task}, 1 slot: draft model vs off",
                on[0],
                off[0],
                "tok/s",
                target_gain,
                note=f"{notes[(task, 'draft')]}; {_same(off[1], on[1])}; {why}",
            )
        )
        if servers:
            srv_off, srv_on = best[(task, "server-off")][0], best[(task, "server-draft")][0]
            figures.append(
                Figure(
                    f"{task}, 1 slot: ours with the draft vs llama-server -md (defaults)",
                    on[0],
                    srv_on,
                    "tok/s",
                    1.2,
                    note=f"llama-server's own gain from -md {srv_on / srv_off:.2f}x ({srv_off:.1f} tok/s without)",
                )
            )
    off, ngram = best[("code edit", "none")], best[("code edit", "ngram")]
    figures.append(
        Figure(
            "code edit, 1 slot: n-gram vs off",
            ngram[0],
            off[0],
            "tok/s",
            1.5,
            note=f"{notes[('code edit', 'ngram')]}; {_same(off[1], ngram[1])}",
        )
    )
    if servers:
        srv_off, srv_on = best[("code edit", "server-off")][0], best[("code edit", "server-ngram")][0]
        figures.append(
            Figure(
                "code edit, 1 slot: our n-gram vs llama-server ngram-simple (defaults)",
                ngram[0],
                srv_on,
                "tok/s",
                1.0,
                note=f"llama-server's own gain {srv_on / srv_off:.2f}x ({srv_off:.1f} tok/s without)",
            )
        )
    return figures


def _draft_server(binary: str, target: Path, draft: Path) -> LlamaServer:
    return LlamaServer(binary, target, threads=0, spec=None, defaults=True, extra=("-md", str(draft)))


def _busy(target: Path, draft: Path, *, n: int, threads: int, log) -> Figure:
    ours = PairEngine(target, draft, threads=threads, slots=4)
    try:
        edits = [ours.chat_tokens(edit_request(name)) for name in ("net_amount", "base", "amount_due", "pre_tax")]
        ours.run_all(edits, 4, "none")
        log("a lone code edit with the draft, so the engine measures what a row costs")
        ours.stream(edits[0], n, "auto")
        outputs: dict[str, list[list[int]]] = {}

        def measured(spec_type: str) -> float:
            rate, outputs[spec_type] = ours.run_all(edits, n, spec_type)
            return rate

        log("4 busy slots, code edits: repeats of off, auto, off again")
        bracket = Bracketed.measure(lambda: measured("none"), lambda: measured("auto"), repeats=5)
        same = sum(a == b for a, b in zip(outputs["none"], outputs["auto"]))
        stats = ours.engine.snapshot()
    finally:
        ours.close()
    return bracket.figure(
        "4 busy slots, code edits: speculation (auto, the draft model) vs off, aggregate",
        1.0,
        note=f"{n} tokens per stream; {stats.accepted_tokens}/{stats.draft_tokens} drafts accepted over the section; "
        f"{same}/4 outputs identical",
    )
