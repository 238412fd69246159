"""Feeds texts through llama.cpp's lazy call grammar, as the sampler accepts an answer's tokens, in a process of its
own: a replayed trigger the grammar rejects aborts the process (llama.cpp throws through its C API), which the
parent test sees as a missing line. Prints one JSON line per case: whether the grammar is holding after the text
(a token no call can hold there is masked).

    python tests/grammar_probe.py MODEL.gguf CASES.json   # CASES: {"grammar", "triggers": [patterns, words],
                                                          #         "texts": [...], "outside": "Hello"}
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import llama_cpp

from localllm.api import GrammarTriggers, LoadOptions
from localllm.backends.llama_cpp.backend import LlamaCppBackend, _grammar_sampler
from localllm.chat.call_formats import LazyGrammar


def holding_after(weights: Path, lazy: LazyGrammar, texts: list[str], folder: Path) -> dict[str, bool]:
    """Run this probe in a process of its own over `texts` (the cases written in `folder`): whether the grammar is
    holding after each. A replay the grammar rejects aborts that process, which fails here."""
    cases = {
        "grammar": lazy.grammar,
        "triggers": [list(lazy.triggers.patterns), list(lazy.triggers.words)],
        "texts": texts,
        "outside": "Hello",
    }
    (folder / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run(
        [sys.executable, __file__, str(weights), str(folder / "cases.json")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"text"')]
    return {line["text"]: line["holding"] for line in lines}


def holds(sampler, token: int) -> bool:
    """Whether the grammar masks `token` now."""
    data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
    array = llama_cpp.llama_token_data_array(data, 1, -1, False)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    return data[0].logit == float("-inf")


def main() -> None:
    weights, cases_file = sys.argv[1:3]
    cases = json.loads(open(cases_file).read())
    model = LlamaCppBackend().load(weights, LoadOptions(num_ctx=256, num_parallel=1, num_thread=1))
    patterns, words = cases["triggers"]
    (outside,) = model.tokenize(cases["outside"], add_special=False)
    for text in cases["texts"]:
        sampler = _grammar_sampler(model, cases["grammar"], GrammarTriggers(tuple(patterns), tuple(words)))
        for token in model.tokenize(text, add_special=False, parse_special=True):
            llama_cpp.llama_sampler_accept(sampler, token)
        print(json.dumps({"text": text, "holding": holds(sampler, outside)}), flush=True)
        llama_cpp.llama_sampler_free(sampler)
    model.close()


if __name__ == "__main__":
    main()
