"""The `tools` section of scripts/bench.py: tool calls on BFCL's non-live categories through localllm and through
llama-server `--jinja`, both at their defaults on the same GGUF, greedy, the same requests on /v1/chat/completions.

BFCL's data, answers and AST checker come from the `bfcl-eval` package, installed (without the vendors' SDKs its
model table would pull in) into a virtual environment of its own under the bench cache; scripts/bfcl_run.py runs
there and talks to each server over loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from localllm.bench.figures import Figure
from localllm.bench.rest import served_model

BFCL_VERSION = "2026.3.23"
# What BFCL's loaders and checker import, pinned as bfcl-eval pins them.
BFCL_NEEDS = ["filelock", "tenacity", "tree_sitter==0.21.3", "tree-sitter-java==0.21.0"]
BFCL_NEEDS += ["tree-sitter-javascript==0.21.4", "jsonschema", "httpx"]
ITEMS = {  # category: items, the first ones in BFCL's order
    "simple_python": 30,
    "simple_java": 10,
    "simple_javascript": 10,
    "multiple": 20,
    "parallel": 15,
    "parallel_multiple": 10,
    "irrelevance": 20,
}
ROUTES = "simple_python=10"  # items asked on all three chat APIs
RUNNER = Path(__file__).resolve().parent / "bfcl_run.py"


def bfcl_python() -> Path:
    """The bench cache's BFCL environment, made on first use."""
    venv = Path.home() / ".cache" / "localllm-bench" / "bfcl-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--no-deps", f"bfcl-eval=={BFCL_VERSION}"], check=True)
        subprocess.run([*pip, *BFCL_NEEDS], check=True)
    return python


def bfcl(base: str, model: str, items: dict[str, int], routes: str | None = None) -> dict[str, dict[str, int]]:
    specs = [f"{category}={count}" for category, count in items.items()]
    run = subprocess.run(
        [str(bfcl_python()), str(RUNNER), "--base", base, "--model", model, "--items", *specs]
        + (["--routes", routes] if routes else []),
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"bfcl_run.py failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def tools_figures(
    path: Path, *, threads: int | None, llama_server: str | None, items: dict[str, int] | None = None
) -> list[Figure]:
    items = items or ITEMS
    with served_model(path, slots=1, threads=threads, n_ctx=4096) as base:
        ours = bfcl(base, "bench", items, routes=ROUTES)
    theirs = None
    if llama_server:
        import bench_spec

        server = bench_spec.LlamaServer(llama_server, path, threads=0, spec=None, defaults=True, extra=["--jinja"])
        try:
            theirs = bfcl(f"http://127.0.0.1:{server.port}", "bench", items)
        finally:
            server.close()
    figures = [figure(category, ours[category], theirs[category] if theirs else None) for category in items]
    same = ours["routes"]
    figures.append(
        Figure(
            f"the same calls on /v1/chat/completions, /api/chat and /v1/messages ({ROUTES})",
            same["agree"],
            same["items"],
            "items",
            target=1.0,
            note="ours only: tools in each API's own shape",
        )
    )
    return figures


def figure(category: str, ours: dict[str, int], theirs: dict[str, int] | None) -> Figure:
    n = ours["items"]
    what = "answered without a call" if category == "irrelevance" else "AST-correct (BFCL's checker)"
    note = f"ours: {ours['well_formed']}/{ours['called']} answers with calls well-formed, {ours['calls']} calls"
    if "second_call_p" in ours:
        chances = sorted(ours["second_call_p"])
        note += f", a second call's chance where the first ends: median {chances[len(chances) // 2]:.3f}"
    if theirs is not None:
        note += f"; llama-server: {theirs['well_formed']}/{theirs['called']} well-formed, {theirs['calls']} calls"
    return Figure(
        f"{category} (first {n}): {what}",
        ours["passed"],
        theirs["passed"] if theirs else float("nan"),
        f"of {n}",
        target=None,
        note=note,
    )
