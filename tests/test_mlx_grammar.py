"""Grammars on the MLX backend (backends/mlx/grammar.py): llama.cpp's GBNF through llguidance, with llama.cpp's
semantics. The mechanics run on a byte-level BPE vocabulary trained in the test (no model); the requests run greedily
through the engine on smollm2 converted to MLX (once per session): a JSON schema, forced tool calls, and a lazy call
grammar that leaves text free and holds a begun call."""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema
import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("llguidance")

import mlx.core as mx  # noqa: E402

from localllm.api import SamplingOptions, Tool  # noqa: E402
from localllm.backends.mlx.grammar import MlxGrammars, _bytes_pattern, trigger_start  # noqa: E402
from localllm.backends.mlx.sampling import MlxSampler  # noqa: E402
from localllm.chat.call_formats import HERMES, JSON_ONLY, MISTRAL, lazy_call_grammar  # noqa: E402
from localllm.chat.tool_calls import parse_tool_calls  # noqa: E402
from localllm.errors import InvalidInput  # noqa: E402

pytestmark = pytest.mark.mlx

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
)
CORPUS = [
    'Sure, {"name": "get_weather", "arguments": {"city": "Paris"}} and {"a": 1}.',
    "Let me check the weather in Paris for you.",
    "yes no nope",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = 2
PADDED = 5  # ids past the tokenizer's, as in an embedding padded to a round size


# ------------------------------------------------------------------------------------------------------- a vocabulary


@dataclass
class _Meta:
    n_vocab: int
    bos_token: int | None = None
    eos_token: int | None = EOS


class VocabOnly:
    """The parts of a loaded model the grammars read, over a trained tokenizer, as MlxModel spells its tokens."""

    def __init__(self, tokenizer):
        from localllm.backends.mlx.meta import make_piece_decoder

        self._tok = tokenizer
        self._pieces = make_piece_decoder(tokenizer)
        self._added = tokenizer.get_added_tokens_decoder()
        self.meta = _Meta(tokenizer.get_vocab_size() + PADDED)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._tok.encode_special_tokens = not parse_special
        try:
            return self._tok.encode(text, add_special_tokens=add_special).ids
        finally:
            self._tok.encode_special_tokens = False

    def token_bytes(self, token: int) -> bytes:
        text = self._tok.id_to_token(token)
        if text is None:
            raise InvalidInput(f"token {token} is outside the vocabulary")
        if token in self._added:
            return b"" if self._added[token].special else text.encode()
        return self._pieces(text)

    def token_text(self, token: int) -> str:
        if token in self._added and self._added[token].special:
            return self._tok.id_to_token(token)
        return self.token_bytes(token).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return token == EOS


def _tokenizer(*, tool_call_token: bool):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    if tool_call_token:  # Qwen's opener: an added token that is not special, so it reads as its text
        tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    return tok


@pytest.fixture(scope="module")
def vocab_model() -> VocabOnly:
    return VocabOnly(_tokenizer(tool_call_token=True))


@pytest.fixture(scope="module")
def grammars(vocab_model) -> MlxGrammars:
    return MlxGrammars(vocab_model)


def _allowed(constraint, n_vocab: int) -> set[int]:
    masked = constraint.constrain(mx.zeros((1, n_vocab)))
    return {int(t) for t in np.nonzero(np.isfinite(np.array(masked[0])))[0]}


def _feed(constraint, model: VocabOnly, text: str) -> None:
    for token in model.tokenize(text, add_special=False):
        constraint.advance(token)


def _byte(model: VocabOnly, char: str) -> int:
    (token,) = model.tokenize(char, add_special=False)
    return token


# ------------------------------------------------------------------------------------------------------- mechanics


def test_a_grammar_holds_from_the_first_token_and_ends_only_where_it_can(grammars, vocab_model):
    n = vocab_model.meta.n_vocab
    constraint = grammars.constraint('root ::= "yes" | "no" "pe"?')
    first = _allowed(constraint, n)
    assert first and all(b"yes".startswith(p) or b"nope".startswith(p) for p in map(grammars.vocab.piece, first))
    assert EOS not in first and not first & {1, 3, n - 1}  # no end, no control token, no padded id
    _feed(constraint, vocab_model, "no")
    after = _allowed(constraint, n)
    assert EOS in after and _byte(vocab_model, "p") in after and _byte(vocab_model, "y") not in after
    _feed(constraint, vocab_model, "pe")
    assert _allowed(constraint, n) == {EOS}  # the grammar is complete: only the end
    assert not constraint.advance(_byte(vocab_model, "s"))


def test_prompt_tokens_count_for_penalties_but_never_advance_the_grammar(grammars, vocab_model):
    n = vocab_model.meta.n_vocab
    favourite = _byte(vocab_model, "p")  # what the "model" wants: not a word's first letter
    logits = mx.zeros((n,)).at[favourite].add(10.0).at[_byte(vocab_model, "n")].add(5.0)
    sampler = MlxSampler(
        lambda row: logits,
        SamplingOptions(temperature=0),
        n_ctx=64,
        n_vocab=n,
        eog={EOS},
        grammar=grammars.constraint('root ::= "yes" | "no" "pe"?'),
    )
    for token in vocab_model.tokenize("no", add_special=False):
        sampler.accept(token)
    assert sampler.sample(0) == _byte(vocab_model, "n")  # the grammar is still at its start
    assert sampler.sample(0) == _byte(vocab_model, "o")


def test_where_the_grammar_leaves_nothing_to_draw_the_answer_ends(grammars, vocab_model):
    """ignore_eos bans the end the complete grammar allows alone: the sampler ends the answer (it never fails the
    engine thread, which samples for every request)."""
    n = vocab_model.meta.n_vocab
    sampler = MlxSampler(
        lambda row: mx.zeros((n,)),
        SamplingOptions(temperature=0, ignore_eos=True),
        n_ctx=64,
        n_vocab=n,
        eog={EOS},
        grammar=grammars.constraint('root ::= "no"'),
    )
    forced = vocab_model.tokenize("no", add_special=False)  # llguidance offers forced text as the tokenizer spells it
    assert [sampler.sample(0) for _ in range(len(forced) + 1)] == [*forced, EOS]


def test_a_lazy_grammar_is_free_until_a_pattern_matches_and_takes_the_text_it_matched(grammars, vocab_model):
    n = vocab_model.meta.n_vocab
    lazy = lazy_call_grammar([WEATHER], JSON_ONLY)
    free = grammars.constraint(lazy.grammar, lazy.triggers)
    _feed(free, vocab_model, 'Sure, {"name": "get_weather", "arguments": {')
    assert _allowed(free, n) == set(range(n))  # a call begun after text is no trigger: the answer stays free
    held = grammars.constraint(lazy.grammar, lazy.triggers)
    head = ' {"name": "get_weather", '
    assert grammars.vocab.piece(vocab_model.tokenize(head, add_special=False)[0]).startswith(b' {"')  # the
    # match begins inside the first token: only its "{..." part is the grammar's
    _feed(held, vocab_model, head)
    allowed = _allowed(held, n)
    assert allowed != set(range(n)) and EOS not in allowed
    _feed(held, vocab_model, '"')
    allowed = _allowed(held, n)  # "arguments" comes next, in the tokens the tokenizer spells it with
    assert allowed and all(b'arguments"'.startswith(grammars.vocab.piece(t)) for t in allowed)


def test_a_trigger_token_is_fed_to_the_grammar_and_a_split_opener_triggers_where_the_answer_ends(grammars, vocab_model):
    n = vocab_model.meta.n_vocab
    lazy = lazy_call_grammar([WEATHER], HERMES)
    constraint = grammars.constraint(lazy.grammar, lazy.triggers)
    _feed(constraint, vocab_model, "Let me check. ")
    assert _allowed(constraint, n) == set(range(n))
    (opener,) = vocab_model.tokenize("<tool_call>", add_special=False)
    constraint.advance(opener)
    allowed = _allowed(constraint, n)
    assert _byte(vocab_model, "{") in allowed and _byte(vocab_model, "x") not in allowed

    pieces = VocabOnly(_tokenizer(tool_call_token=False))  # [TOOL_CALLS] is spelt in pieces: a pattern
    lazy = lazy_call_grammar([WEATHER], MISTRAL)
    constraint = MlxGrammars(pieces).constraint(lazy.grammar, lazy.triggers)
    _feed(constraint, pieces, "Sure. [TOOL_CALLS]")
    allowed = _allowed(constraint, pieces.meta.n_vocab)
    assert _byte(pieces, "[") in allowed and _byte(pieces, "{") not in allowed


def test_the_probe_counts_the_draft_the_grammar_allows_up_to_an_end(grammars, vocab_model):
    probe = grammars.probe('root ::= "yes" | "no" "pe"?')
    no, pe = (vocab_model.tokenize(t, add_special=False) for t in ("no", "pe"))
    assert probe.allowed([], no) == len(no)
    assert probe.allowed(no, [*pe, EOS, *no]) == len(pe)
    assert probe.allowed(no, vocab_model.tokenize("s", add_special=False)) == 0
    probe.close()


def test_a_grammar_that_does_not_parse_is_a_bad_request(grammars):
    for bad in ('root ::= "a" (', 'root ::= missing-rule "a"', 'other ::= "a"'):
        with pytest.raises(InvalidInput, match="does not parse") as err:
            grammars.constraint(bad)
        assert err.value.status_code == 400


def test_a_pattern_ends_only_where_the_text_ends_as_in_llama_cpp():
    pattern = _bytes_pattern(r"(<x>[ \t\r\n]{0,2})$")
    assert trigger_start(pattern, b"ok <x>") == 3
    assert trigger_start(_bytes_pattern("(<x>)$"), b"ok <x>\n") is None  # Python's $ would match before "\n"
    assert trigger_start(_bytes_pattern(r"^\s*(\{)$"), b"  {") == 2  # the first non-empty group's start


def test_every_call_formats_lazy_grammar_compiles_and_holds_from_its_trigger(grammars, vocab_model):
    from localllm.chat import call_formats

    formats = [v for v in vars(call_formats).values() if isinstance(v, call_formats.CallFormat)]
    add = Tool.model_validate({"type": "function", "function": {"name": "add"}})
    for fmt in formats:
        for parallel in (True, False):
            lazy = lazy_call_grammar([WEATHER, add], fmt, parallel=parallel)
            held = grammars.constraint(lazy.grammar)
            assert len(_allowed(held, vocab_model.meta.n_vocab)) < vocab_model.meta.n_vocab, fmt.name
            grammars.constraint(lazy.grammar, lazy.triggers)


# ------------------------------------------------------------------------------------------------------- real models
# smollm2's template renders no tools (and the converter takes llama architectures, not Qwen's): the tool cases show
# it the call format in an earlier turn, which it follows.

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
}
ADD = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
)


def _place_tool(location: dict) -> Tool:
    parameters = {"type": "object", "properties": {"location": location}, "required": ["location"]}
    return Tool.model_validate({"type": "function", "function": {"name": "find_place", "parameters": parameters}})


def _shown_a_call(opener: str = "", closer: str = "") -> list[dict]:
    """A conversation whose earlier turn answers with a call (its location an object), `opener`/`closer` around it."""
    call = '{"name": "find_place", "arguments": {"location": {"city": "Paris", "country": "France"}}}'
    return [
        {"role": "system", "content": "You call tools by answering with one JSON object naming the tool."},
        {"role": "user", "content": "Find cafes near Paris, France."},
        {"role": "assistant", "content": opener + call + closer},
        {"role": "user", "content": "Find cafes near Istanbul, Turkey."},
    ]


@pytest.fixture(scope="module")
def engine(smollm2_mlx):
    from localllm.api import LoadOptions
    from localllm.backends.mlx import MlxBackend
    from localllm.engine.runner import ModelEngine
    from localllm.engine.speculative.policy import FixedWindow
    from localllm.engine.speculative.speculation import Speculation

    model = MlxBackend().load(smollm2_mlx, LoadOptions(num_ctx=1024, num_parallel=1))
    # n-gram drafting whenever a request asks for it (a fixed window drafts whatever the machine's load)
    engine = ModelEngine(model, max_queue=2, speculation=Speculation(model, window=FixedWindow))
    yield engine
    engine.close()


def _answer(
    engine, messages: list[dict], grammar: str | None = None, triggers=None, *, spec_type: str = "none"
) -> tuple[str, str | None]:
    """The greedy answer to `messages` (smollm2's template) under `grammar`, and why it ended."""
    return _generate(engine, messages, grammar, triggers, spec_type=spec_type)[:2]


def _generate(engine, messages: list[dict], grammar: str | None, triggers=None, *, spec_type: str = "none"):
    from localllm.chat.templates import render_chat
    from localllm.engine.runner import GenerationParams

    prompt = engine.tokenize(render_chat(engine.model.meta.chat_template, messages), add_special=False)
    greedy = SamplingOptions(temperature=0, num_predict=60, spec_type=spec_type, spec_max_draft=4)
    text, last = [], None
    for chunk in engine.submit(GenerationParams(prompt, greedy, grammar, grammar_triggers=triggers)):
        text.append(chunk.text)
        last = chunk
    return "".join(text), last.done_reason if last else None, last


def _call(answer: str) -> tuple[str, dict]:
    call = json.loads(answer)
    return call["name"], call["arguments"]


@pytest.mark.models
def test_a_json_schema_gives_json_that_validates(engine):
    from localllm.chat.structured import grammar_for_format

    ask = [{"role": "user", "content": "Describe a fictional person as JSON with name, age and hobbies."}]
    answer, reason = _answer(engine, ask, grammar_for_format(PERSON))
    assert reason == "stop"
    jsonschema.validate(json.loads(answer), PERSON)
    # drafts are checked against the grammar (the GrammarChecks probe) and verified: the same answer
    drafted, _, last = _generate(engine, ask, grammar_for_format(PERSON), spec_type="ngram")
    assert drafted == answer and last.timings.draft_count > 0


@pytest.mark.models
def test_a_forced_call_is_a_well_formed_call_to_an_offered_tool(engine):
    from localllm.chat.structured import tool_call_schema, tool_choice_grammar

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, names in (("required", {"get_weather", "add"}), ({"function": {"name": "add"}}, {"add"})):
        answer, reason = _answer(engine, ask, tool_choice_grammar([WEATHER, ADD], choice))
        name, arguments = _call(answer)
        assert reason == "stop" and name in names, answer
        jsonschema.validate({"name": name, "arguments": arguments}, tool_call_schema([WEATHER, ADD], name=name))


@pytest.mark.models
def test_a_lazy_grammar_leaves_text_free_and_holds_a_begun_call_to_the_offered_tools_schema(engine):
    """The conversation shows a call whose location is an object; the offered tool takes a string. Free, the model
    follows the conversation; held, once its call begins (bare JSON, or after Hermes's opener, which smollm2 spells in
    pieces), the offered schema holds. An answer that begins no call is never held."""
    as_string = _place_tool({"type": "string"})
    assert isinstance(_call(_answer(engine, _shown_a_call())[0])[1]["location"], dict)
    for fmt, opener, closer in ((JSON_ONLY, "", ""), (HERMES, "<tool_call>\n", "\n</tool_call>")):
        lazy = lazy_call_grammar([as_string], fmt)
        answer, reason = _answer(engine, _shown_a_call(opener, closer), lazy.grammar, lazy.triggers)
        assert reason == "stop" and answer.startswith(opener), answer
        name, arguments = _call(answer.removeprefix(opener).removesuffix(closer.strip()).strip())
        assert name == "find_place" and isinstance(arguments["location"], str), answer
    lazy = lazy_call_grammar([as_string], HERMES)
    hello = [*_shown_a_call()[:3], {"role": "user", "content": "Thanks! Now just say hello to me."}]
    answer, reason = _answer(engine, hello, lazy.grammar, lazy.triggers)
    # held, it could only have been a whole call to find_place: whatever smollm2 writes here (text, or JSON naming
    # no offered tool) is left as it is
    assert reason == "stop" and answer and not parse_tool_calls(answer, [as_string])[1], answer
