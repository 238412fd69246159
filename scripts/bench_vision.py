"""The vision section of scripts/bench.py: time to first token of a chat request with one image, ours against
llama-server --mmproj on the same files.

The text model is the section's model (smollm2:135m by default); the projector is the synthetic LLaVA-style one the
tests use (tests/vision_model.py, random weights, written to a temporary folder), made as wide as the model's
embeddings. Each request sends a new image (other pixels), so no cache on either side can hide its decode and
encode, through /v1/chat/completions as an OpenAI `image_url` data URI, greedy, one token: the reply's time on the
client's clock is the time to the first token. Both servers run at their defaults otherwise.

    python scripts/bench.py --only vision --llama-server PATH"""

from __future__ import annotations

import base64
import itertools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_embed import llama_server

from localllm import config
from localllm.bench import rest
from localllm.bench.figures import Bracketed, Figure

IMAGE_SIDE = 512  # pixels: a photo-sized file to decode (the projector then scales it to its own 32)
QUESTION = "What is in this picture?"


def _first_token_ms(base: str, image: bytes, prompt_tokens: list[int]) -> float:
    """Milliseconds until the one-token answer about `image` is back; its prompt's token count is noted."""
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    # The image first: where our server puts a message's images, so both servers read the same prompt.
    content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTION}]
    body = {"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    reply = rest.http_client().post(f"{base}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    prompt_tokens.append(reply.json()["usage"]["prompt_tokens"])
    return elapsed * 1000


def vision_figures(
    path: Path, *, llama_server_binary: str | None, repeats: int = 3, log: Callable[[str], None] = print
) -> list[Figure]:
    if not llama_server_binary:
        log("no llama-server binary (LLAMA_SERVER=$(bash scripts/build_llama_server.sh)): the vision section needs it")
        return []
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from vision_model import png, write_projector

    from localllm.quant.gguf import inspect_gguf

    seeds = itertools.count()
    tokens: dict[str, list[int]] = {"ours": [], "theirs": []}

    def measured(name: str, base: str) -> Callable[[], float]:
        return lambda: _first_token_ms(base, png(next(seeds), IMAGE_SIDE), tokens[name])

    with tempfile.TemporaryDirectory(prefix="localllm-vision-") as folder:
        projector = write_projector(Path(folder) / "mmproj.gguf", text_embd=inspect_gguf(path).embedding_length)
        with (
            rest.served_model(
                path,
                slots=config.NUM_PARALLEL.get(),
                threads=None,
                n_ctx=config.CONTEXT_LENGTH.get(),
                projector=projector,
            ) as ours,
            llama_server(llama_server_binary, path, "--mmproj", str(projector)) as theirs,
        ):
            ours_run, theirs_run = measured("ours", ours), measured("theirs", theirs)
            ours_run(), theirs_run()  # warm-up: the first image sets up each side's vision encoder
            log(f"vision: a new {IMAGE_SIDE}x{IMAGE_SIDE} PNG per request, llama-server and ours, {repeats} repeats")
            run = Bracketed.measure(theirs_run, ours_run, repeats=repeats)
    figure = run.figure(
        "time to first token, one new image: ours vs llama-server --mmproj",
        1.03,
        lower_is_better=True,
        note=f"/v1/chat/completions, a {IMAGE_SIDE}x{IMAGE_SIDE} PNG data URI and a question, greedy, max_tokens 1, "
        f"both at their defaults; a synthetic LLaVA-style projector; prompt tokens ours "
        f"{sorted(set(tokens['ours']))}, llama-server {sorted(set(tokens['theirs']))}",
    )
    figure.unit = "ms"
    return [figure]
