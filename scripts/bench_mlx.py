"""The MLX section of scripts/bench.py: MLX against llama.cpp through the same engine and Protocol."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localllm.api import LoadOptions
from localllm.bench.engine import LONG_STORY, engine_run
from localllm.bench.figures import Figure
from localllm.engine.runner import ModelEngine


def run_mlx_benchmarks(
    path: Path, *, n: int = 32, n_ctx: int = 1024, log: Callable[[str], None] = print
) -> list[Figure]:
    """MLX against llama.cpp through the same engine and Protocol: the GGUF converted to MLX (Q4_1 repacked), one
    stream, the same prompt tokens, greedy. Informational on Linux, where MLX runs on the CPU with reference BLAS."""
    import tempfile

    from localllm.backends import get_backend
    from localllm.quant.mlx_convert import convert_gguf_to_mlx

    with tempfile.TemporaryDirectory(prefix="localllm-mlx-bench-") as tmp:
        log("MLX: converting the GGUF")
        folder = convert_gguf_to_mlx(path, Path(tmp) / "mlx")
        rates = {}
        for name, weights in (("llama.cpp", path), ("mlx", folder)):
            log(f"MLX: {name}")
            model = get_backend(name).load(weights, LoadOptions(num_thread=1, num_ctx=n_ctx, num_parallel=1))
            engine = ModelEngine(model, max_queue=1)
            try:
                prompt = engine.tokenize(LONG_STORY * 8)[:128]
                run = engine_run(engine, [prompt], n)
                rates[name] = (len(prompt) / run.ttft(), run.rate())
            finally:
                engine.close()
    note = "1 thread, 128-token prompt; MLX's CPU build is a test target on Linux, not a fast path"
    return [
        Figure("MLX prefill vs llama.cpp", rates["mlx"][0], rates["llama.cpp"][0], "tok/s", 0.0, note=note),
        Figure("MLX decode vs llama.cpp", rates["mlx"][1], rates["llama.cpp"][1], "tok/s", 0.0, note=note),
    ]
