"""Benchmarks as ratios against a reference measured in the same process: the raw llama.cpp decode loop through
llama-cpp-python's low-level API (no scheduler, greedy sampling, the same model, threads and tokens).

    raw.py      the reference loops (single, batched, prefill) on llama.cpp's low-level API
    figures.py  Figure (one line: ours, reference, ratio, target) and Bracketed (reference, ours, reference repeats)
    engine.py   our engine's runs and the engine figures (`localllm bench MODEL`)
    rest.py     the same through `localllm serve` in a subprocess (`localllm bench --rest`)

Used by `localllm bench MODEL` and scripts/bench.py (which also writes docs/BENCHMARKS.md and runs llama-server and
MLX), and by the tests that check our engine's greedy output equals the raw loop token for token."""
