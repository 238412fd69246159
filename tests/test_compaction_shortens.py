"""A compaction must shorten (issue 46): with smollm2, compacting a 740-token history once made the next turn 893
tokens, the summary longer than what it replaced. Whatever the history (mostly the user's words, or mostly the
model's), the compacted conversation is counted shorter than the original, by the model's own template."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_harness import private_home, served

pytestmark = pytest.mark.models

MODEL = "smollm2:135m"
LOG = " ".join(f"step {i}: compiled module {i} with two warnings about unused imports" for i in range(12))
HISTORIES = {
    # Long pasted logs, one-word answers: almost nothing but the user's words, which a compaction keeps.
    "mostly the user's": [
        message
        for turn in range(4)
        for message in (
            {"role": "user", "content": f"Build log {turn}: {LOG}"},
            {"role": "assistant", "content": "Noted."},
        )
    ],
    # Short questions, long answers: the model's words, which the summary replaces.
    "mostly the model's": [
        message
        for turn in range(4)
        for message in (
            {"role": "user", "content": f"What happened in build {turn}?"},
            {"role": "assistant", "content": f"In build {turn}, {LOG}. Nothing failed."},
        )
    ],
}
ASK = {"role": "user", "content": "Go on."}


@pytest.fixture(scope="module")
def oai(models_home, tmp_path_factory) -> Iterator[openai.OpenAI]:
    home = private_home(models_home, tmp_path_factory.mktemp("compaction"))
    with served(home, LOCALLLM_CONTEXT_LENGTH="2048", LOCALLLM_NUM_PARALLEL="1") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def prompt_tokens(oai: openai.OpenAI, items: list) -> int:
    answer = oai.responses.create(model=MODEL, input=[*items, ASK], max_output_tokens=1, temperature=0)
    assert answer.usage is not None
    return answer.usage.input_tokens


@pytest.mark.parametrize("history", list(HISTORIES))
def test_a_compacted_conversation_is_shorter_than_the_original(oai, history):
    items = HISTORIES[history]
    compacted = oai.responses.compact(model=MODEL, input=items)
    assert compacted.output[-1].type == "compaction"
    kept = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
    original, shorter = prompt_tokens(oai, items), prompt_tokens(oai, kept)
    assert shorter < original, (shorter, original)
