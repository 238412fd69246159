#!/usr/bin/env python
"""Benchmarks of localllm against raw llama.cpp, measured in one run on this machine; writes docs/BENCHMARKS.md.

Every figure is a ratio against a reference taken in the same run (the raw llama.cpp loop through llama-cpp-python's
low-level API on the same model, threads and tokens, or our own engine where the figure compares two of our runs).

    python scripts/bench.py                          # all sections, catalog models from the local store
    python scripts/bench.py --only engine rest       # some sections
    python scripts/bench.py --models smollm2:135m --tokens 64 --no-write
    python scripts/bench.py --only vision --llama-server PATH   # one image's first token, against llama-server
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_mlx import run_mlx_benchmarks  # noqa: E402

from localllm.bench import engine, rest  # noqa: E402
from localllm.bench.figures import Figure  # noqa: E402

Section = Callable[[Path, argparse.Namespace], list[Figure]]


def engine_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    return engine.run_benchmarks(path, n=args.tokens, threads=args.threads)


def rest_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    other = partial(llama_server_streams, args.llama_server, path, args) if args.llama_server else None
    return rest.run_rest_benchmarks(path, n=args.tokens, threads=args.threads, other_server=other)


@contextmanager
def llama_server_streams(
    binary: str, path: Path, args: argparse.Namespace, prompts: list[list[int]], n: int
) -> Iterator[rest.OtherServer]:
    """llama.cpp's own server with 4 slots, measured on the same prompts as ours: the four requests streamed at once
    and timed on the client's clock, after every stream's first token."""
    import bench_spec

    from localllm import config
    from localllm.machine import physical_cores

    threads = args.threads or config.NUM_THREAD.get() or physical_cores()
    server = bench_spec.LlamaServer(binary, path, threads=threads, spec=None, slots=len(prompts), ctx_per_slot=4096)

    def one(i: int, run: engine.EngineRun) -> None:
        server.stream(prompts[i], n, partial(run.received, i), ignore_eos=True)

    def measure() -> float:
        return engine.concurrent_streams(engine.EngineRun.start(len(prompts)), one).rate()

    try:
        server.complete(prompts[0][:8], 4)  # warm up
        yield rest.OtherServer(f"llama-server -np {len(prompts)} ({threads} thread(s))", measure)
    finally:
        server.close()


def spec_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Speculative decoding (scripts/bench_spec.py). Needs a model that can copy code (gemma3:270m does, smollm2 does
    not): `python scripts/bench.py --models gemma3:270m --only spec --llama-server PATH`."""
    import bench_spec

    return bench_spec.spec_figures(
        path, n=max(args.tokens, 300), threads=args.threads, repeats=5, llama_server=args.llama_server
    )


def pair_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Speculation on a real draft pair (scripts/bench_spec_pair.py): the model drafted by --draft.
    `python scripts/bench.py --models qwen2.5-coder:1.5b --only pair --llama-server PATH`."""
    import bench_spec_pair

    return bench_spec_pair.pair_figures(
        path, model_path(args.draft), n=max(args.tokens, 200), repeats=3, llama_server=args.llama_server
    )


def defaults_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Ours at its defaults (threads tuned as it runs) against llama-server's defaults and the best raw thread count,
    idle and with a core busy (scripts/bench_threads.py)."""
    import bench_threads

    return bench_threads.thread_figures(path, n=args.tokens, llama_server=args.llama_server)


def prefix_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """More conversations than slots: returning turns, a restart, llama-server's --cache-ram (scripts/bench_prefix.py).
    `python scripts/bench.py --models smollm2:135m gemma3:270m --only prefix --llama-server PATH`."""
    import bench_prefix

    return bench_prefix.prefix_figures(path, threads=args.threads, llama_server_binary=args.llama_server)


def editor_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Editor completion: typing replayed through /infill, each keystroke cancelling the last (scripts/bench_editor.py).
    `python scripts/bench.py --models qwen2.5-coder:0.5b --only editor --llama-server PATH`."""
    import bench_editor

    return bench_editor.editor_figures(path, llama_server=args.llama_server)


def prompts_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Long prompts (1K to 16K tokens, distinct text) served at both servers' defaults: time to first token, decode
    after it and the cost curve (scripts/bench_prompts.py).
    `python scripts/bench.py --models qwen2.5-coder:0.5b --only prompts --llama-server PATH`."""
    import bench_prompts

    sizes = args.prompt_sizes or bench_prompts.SIZES
    return bench_prompts.prompt_figures(path, llama_server=args.llama_server, sizes=sizes, repeats=args.repeats)


def mixed_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Three streams decoding as a long prompt arrives, ours and llama-server's (scripts/bench_serving.py)."""
    return _serving(path, args)[0]


def memory_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Server RSS idle with one model and after the mixed load (scripts/bench_serving.py)."""
    return _serving(path, args)[1]


_SERVING: dict[tuple[Path, int, str | None], tuple[list[Figure], list[Figure]]] = {}


def _serving(path: Path, args: argparse.Namespace) -> tuple[list[Figure], list[Figure]]:
    """The mixed load and the memory after it come from one run: measured once for both sections."""
    import bench_serving

    key = (path, args.tokens, args.llama_server)
    if key not in _SERVING:
        _SERVING[key] = bench_serving.mixed_and_memory_figures(
            path, n=max(args.tokens, 256), llama_server_binary=args.llama_server
        )
    return _SERVING[key]


def first_load_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """The first load of a model on a fresh home against a repeated load, and the first `localllm run` after a pull
    (scripts/bench_serving.py)."""
    import bench_serving

    return bench_serving.first_load_figures(path) + bench_serving.first_run_figures(path)


def mlx_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    return run_mlx_benchmarks(path)


def mlx_pair_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """A real draft pair converted to MLX: the draft model against off (localllm/bench/mlx.py).
    `python scripts/bench.py --models qwen2.5-coder:1.5b --only mlxpair` (the draft: --draft)."""
    from localllm.bench.mlx import run_mlx_pair_benchmarks

    return run_mlx_pair_benchmarks(path, model_path(args.draft), n=min(args.tokens, 32), repeats=args.repeats)


def mlx_served_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """localllm serve on the GGUF converted with `create --format mlx` against mlx_lm.server at its defaults on the same
    files, over /v1/chat/completions (localllm/bench/mlx.py). `python scripts/bench.py --only mlxserve`."""
    from localllm.bench.mlx import run_mlx_server_benchmarks

    return run_mlx_server_benchmarks(path, n=min(args.tokens, 32), repeats=args.repeats)


def rpc_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Decode with every layer on a `localllm worker` over loopback against local decode (scripts/bench_rpc.py)."""
    from bench_rpc import run_rpc_benchmarks

    return run_rpc_benchmarks(path, n=args.tokens, threads=args.threads)


def embed_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """256 short texts through /v1/embeddings against llama-server --embeddings (scripts/bench_embed.py).
    `python scripts/bench.py --models nomic-embed-text --only embed --llama-server PATH`."""
    import bench_embed

    return bench_embed.embed_figures(path, llama_server_binary=args.llama_server, repeats=args.repeats)


def rerank_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """64 documents through /v1/rerank against llama-server --rerank, on a synthetic cross-encoder the section writes
    itself (`path`, a catalog model, is not used; scripts/bench_embed.py).
    `python scripts/bench.py --only rerank --llama-server PATH`."""
    import bench_embed

    return bench_embed.rerank_figures(llama_server_binary=args.llama_server, repeats=args.repeats)


def vision_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Time to first token with one image against llama-server --mmproj, `path` the text model under a synthetic
    projector the section writes itself (scripts/bench_vision.py). `python scripts/bench.py --only vision
    --llama-server PATH`."""
    import bench_vision

    return bench_vision.vision_figures(path, llama_server_binary=args.llama_server, repeats=args.repeats)


def bandwidth_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """One stream's decode at the defaults as a share of the measured memory read bandwidth, ours and llama-server's
    (scripts/bench_embed.py). `python scripts/bench.py --models qwen2.5-coder:1.5b --only bandwidth`."""
    import bench_embed

    return bench_embed.bandwidth_figures(
        path, n=args.tokens, llama_server_binary=args.llama_server, repeats=args.repeats
    )


def web_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """The web page's first load and its Send to first token painted, against the API's own first token
    (scripts/bench_web.py; needs chromium and playwright, as the browser tests do)."""
    import bench_web

    return bench_web.web_figures(path, threads=args.threads)


def tools_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Tool calls on BFCL's non-live categories against llama-server --jinja (scripts/bench_tools.py): needs a
    tool-calling model, `--models qwen2.5-coder:0.5b --only tools --llama-server PATH`."""
    import bench_tools

    return bench_tools.tools_figures(path, threads=args.threads, llama_server=args.llama_server)


def agents_section(path: Path, args: argparse.Namespace) -> list[Figure]:
    """Claude Code's real first request and its second turn, time to first event and token and the tokens reused,
    ours and llama-server's at their defaults (scripts/bench_agents.py).
    `python scripts/bench.py --models qwen2.5-coder:1.5b --only agents --llama-server PATH`."""
    import bench_agents

    tools = args.agent_tools.split(",") if args.agent_tools else None
    return bench_agents.agent_figures(path, llama_server=args.llama_server, tools=tools, repeats=args.repeats)


SECTIONS: dict[str, tuple[str, Section]] = {
    "engine": ("Engine against raw llama.cpp", engine_section),
    "rest": ("REST path against raw llama.cpp", rest_section),
    "defaults": ("Defaults: threads tuned as the model runs", defaults_section),
    "spec": ("Speculative decoding", spec_section),
    "pair": ("Speculation on a real draft pair", pair_section),
    "prefix": ("Prefix cache beyond the slots", prefix_section),
    "editor": ("Editor completion (fill in the middle)", editor_section),
    "prompts": ("Long prompts at the defaults against llama-server", prompts_section),
    "mixed": ("Mixed load: decoders beside a long prompt", mixed_section),
    "memory": ("Memory at the defaults", memory_section),
    "firstload": ("First load of a new model", first_load_section),
    "mlx": ("MLX against llama.cpp (informational)", mlx_section),
    "mlxserve": ("MLX served against mlx_lm.server", mlx_served_section),
    "mlxpair": ("MLX speculation on a real draft pair", mlx_pair_section),
    "rpc": ("RPC worker over loopback (informational)", rpc_section),
    "embed": ("Embeddings against llama-server", embed_section),
    "rerank": ("Reranking against llama-server", rerank_section),
    "vision": ("Vision: first token with an image against llama-server", vision_section),
    "bandwidth": ("Decode against memory bandwidth (informational)", bandwidth_section),
    "web": ("Web page: first load and first token painted", web_section),
    "tools": ("Tool calls on BFCL against llama-server --jinja", tools_section),
    "agents": ("Agents: Claude Code's first two turns against llama-server", agents_section),
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    cpu = cpu_name()
    import llama_cpp

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, llama-cpp-python {llama_cpp.__version__} (CPU build)"
    )


def render(results: list[tuple[str, str, list[Figure]]], args: argparse.Namespace) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Machine of the latest run: {machine()}. Each section names the CPU it was measured on (before "
        "2026-12-02: an Intel Xeon, 2 cores).",
        "",
        f"Measured by `python scripts/bench.py`, each section on the date it shows (this run: `--tokens "
        f"{args.tokens}` for the engine and REST sections; the speculative sections use 300 and 150 tokens and MLX 32, "
        "as their notes say). Every ratio is ours / reference, both measured in the same run. CPU figures on a "
        "shared 2-core machine move by a percent or more between runs: figures that compare equal work are medians "
        "of repeats with the reference measured on either side of ours, and their target allows only the spread "
        "between those two reference runs. A miss is recorded with its reason, never hidden.",
        "",
    ]
    measured = [section_block(model, title, figures) for model, title, figures in results]
    lines += in_section_order(measured + earlier_sections({f"## {title} — {model}" for model, title, _ in results}))
    notes = ROOT / "docs" / "benchmark-notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    return "\n".join(lines)


def section_block(model: str, title: str, figures: list[Figure]) -> str:
    lines = [
        f"## {title} — {model}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {cpu_name()} ({os.cpu_count()} cores).",
        "",
        "| figure | ours | reference | ratio | target | met | note |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f.name} | {f.ours:.1f} {f.unit} | {f.reference:.1f} {f.unit} | {f.ratio:.2f} | "
            f"{f.target_text} | {f.met_text} | {f.note} |"
        )
    return "\n".join(lines) + "\n"


def in_section_order(blocks: list[str]) -> list[str]:
    """Sections in SECTIONS' order (engine, REST, defaults, prefix cache, speculation, MLX), whichever run measured
    them; models keep the order they come in."""
    titles = [f"## {title} — " for title, _ in SECTIONS.values()]
    return sorted(blocks, key=lambda block: next(i for i, t in enumerate(titles) if block.startswith(t)))


def earlier_sections(measured: set[str]) -> list[str]:
    """Sections of the existing docs/BENCHMARKS.md that this run did not measure, kept as they were (each with its
    own date line), so a run with --only or other --models does not erase other figures."""
    out = ROOT / "docs" / "BENCHMARKS.md"
    if not out.exists():
        return []
    titles = tuple(f"## {title} — " for title, _ in SECTIONS.values())
    blocks = re.split(r"(?m)^(?=## )", out.read_text())[1:]
    return [b.rstrip() + "\n" for b in blocks if b.startswith(titles) and b.splitlines()[0] not in measured]


def model_path(name: str) -> Path:
    from localllm.models.store import Store

    return Store().resolve(name).weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="sections to run (default: all)")
    parser.add_argument("--models", nargs="*", default=["smollm2:135m"], help="pulled models to measure")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft", default="qwen2.5-coder:0.5b", help="the pair section's draft model")
    parser.add_argument(
        "--repeats", type=int, default=3, help="repeats of the embed, vision, bandwidth, prompts and agents sections"
    )
    parser.add_argument(
        "--prompt-sizes", nargs="+", type=int, default=None, help="the prompts section's prompt tokens (default 1K-16K)"
    )
    parser.add_argument(
        "--agent-tools",
        default=None,
        help="the agents section's tools, e.g. Read,Write,Bash as `claude --tools` (default: all 24, the real size)",
    )
    parser.add_argument("--threads", type=int, default=None, help="our engine's threads (default: its own)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    parser.add_argument(
        "--llama-server",
        default=os.environ.get("LLAMA_SERVER"),
        help="llama.cpp's llama-server binary, for the spec section's side-by-side (env LLAMA_SERVER)",
    )
    args = parser.parse_args()
    results = []
    for model in args.models:
        path = model_path(model)
        for key in args.only or list(SECTIONS):
            title, section = SECTIONS[key]
            print(f"== {title}: {model}", flush=True)
            figures = section(path, args)
            for f in figures:
                print(
                    f"  {f.name:42} ours {f.ours:9.1f} ref {f.reference:9.1f} {f.unit:5} ratio {f.ratio:5.2f} "
                    f"{ {True: 'met', False: 'MISSED', None: 'info'}[f.met] }  {f.note}",
                    flush=True,
                )
            results.append((model, title, figures))
    text = render(results, args)
    if not args.no_write:
        out = ROOT / "docs" / "BENCHMARKS.md"
        tmp = out.with_suffix(".md.tmp")
        tmp.write_text(text)
        tmp.replace(out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
