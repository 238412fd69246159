"""Vision models (issue 31): a model stored with a vision projector, a `clip` GGUF given by a second FROM (Ollama's
way) or uploaded beside the weights, shown with the `vision` capability and counted by `localllm plan`; images in
Ollama chat and generate requests, served by the real app to the real `ollama` client, their prefix reused, their
answers equal to llama.cpp's own llama-mtmd-cli on the same files, and every bad image a 400 before any decode. The
projectors are the synthetic ones of tests/vision_model.py, over smollm2:135m's embeddings."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from reference_tools import reference_tool
from server_harness import private_home, served
from tiny_models import write_tiny_llama
from typer.testing import CliRunner
from vision_model import N_PATCHES, png, write_projector

from localllm import api
from localllm.cli.app import app
from localllm.errors import InvalidInput, ModelfileError, ModelFormatError
from localllm.models.create import create_model
from localllm.models.info import show_model
from localllm.models.modelfile import parse_modelfile, render_modelfile
from localllm.models.store import MEDIA_PROJECTOR, Store

pytestmark = pytest.mark.models


def _drain(stream) -> list[api.PullProgress]:
    return list(stream)


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path) -> Path:
    """A folder with smollm2's weights (a link), its projector and one that is too wide for it."""
    folder = tmp_path_factory.mktemp("vision")
    (folder / "smollm2.gguf").symlink_to(smollm2_path)
    write_projector(folder / "mmproj.gguf")
    write_projector(folder / "wide-mmproj.gguf", text_embd=640)
    write_projector(folder / "idefics3-mmproj.gguf", kind="idefics3")
    write_projector(folder / "unknown-mmproj.gguf", kind="no-such-projector")  # a clip GGUF mtmd cannot load
    # SmolVLM's layout whole: a text model whose vocabulary has the markers mtmd wraps an idefics3 image in (its
    # overview and one tile), under the same projector at that model's width. Greedy text is whole words.
    write_tiny_llama(folder / "tiny-smolvlm.gguf", added=IDEFICS3_MARKERS, writes_bytes=False)
    write_projector(folder / "tiny-idefics3-mmproj.gguf", kind="idefics3", text_embd=TINY_EMBD)
    return folder


@pytest.fixture(scope="module")
def store(tmp_path_factory, files) -> Store:
    """A store with smollm2 as `smol` (no projector) and `smolvlm` (smol with the projector)."""
    store = Store(tmp_path_factory.mktemp("home") / "models")
    _create(store, "smol", f"FROM {files / 'smollm2.gguf'}\n", files)  # absolute: a link kept as named
    _create(store, "smolvlm", "FROM smol\nFROM ./mmproj.gguf\n", files)
    return store


def _create(store: Store, name: str, modelfile: str, base: Path) -> list[api.PullProgress]:
    return _drain(create_model(api.CreateRequest(model=name, modelfile=modelfile), store, base_dir=base))


def test_a_second_from_is_the_projector_and_renders_back():
    request = parse_modelfile("FROM smollm2:135m\nFROM ./mmproj.gguf\nSYSTEM hi\n")
    assert (request.from_, request.projector) == ("smollm2:135m", "./mmproj.gguf")
    again = parse_modelfile(render_modelfile(from_="smollm2:135m", projector="./mmproj.gguf", system="hi"))
    assert (again.from_, again.projector, again.system) == ("smollm2:135m", "./mmproj.gguf", "hi")


def test_a_third_from_names_the_lines():
    with pytest.raises(ModelfileError, match=r"line 3: FROM given three times \(lines 1 and 2\)"):
        parse_modelfile("FROM a\nFROM ./p.gguf\nFROM ./q.gguf\n")


def test_the_projector_is_a_layer_of_its_own_and_shows_vision(store):
    model = store.resolve("smolvlm")
    assert model.projector is not None and model.projector.is_file()
    assert store.projector_layers("smolvlm") and not store.projector_layers("smol")
    shown = show_model(store, "smolvlm")
    assert "vision" in shown.capabilities and "vision" not in show_model(store, "smol").capabilities
    assert shown.projector_info is not None
    assert shown.projector_info["general.architecture"] == "clip"
    assert shown.projector_info["clip.projector_type"] == "mlp"
    assert show_model(store, "smol").projector_info is None
    # The weights are the same blob: only the projector layer is new.
    assert model.weights == store.resolve("smol").weights


def test_a_model_built_on_a_vision_model_keeps_its_projector(store, files):
    _create(store, "smolvlm-pirate", "FROM smolvlm\nSYSTEM You are a pirate.\n", files)
    assert store.resolve("smolvlm-pirate").projector == store.resolve("smolvlm").projector
    assert "vision" in show_model(store, "smolvlm-pirate").capabilities


def test_a_second_from_that_is_no_projector_is_refused_before_writing(store, files):
    with pytest.raises(ModelFormatError, match="not a vision projector: its architecture is 'llama', not 'clip'"):
        _create(store, "bad", f"FROM smol\nFROM {files / 'smollm2.gguf'}\n", files)
    assert not store.exists("bad")


def test_the_froms_may_come_in_either_order(store, files):
    """As in Ollama: whichever FROM is a `clip` GGUF is the projector."""
    _create(store, "swapped", f"FROM ./mmproj.gguf\nFROM {files / 'smollm2.gguf'}\n", files)
    model = store.resolve("swapped")
    assert model.projector == store.resolve("smolvlm").projector
    assert model.weights == store.resolve("smol").weights


def test_a_projector_alone_is_no_model(store, files):
    with pytest.raises(InvalidInput, match="is a vision projector, not a model") as err:
        _create(store, "bad", "FROM ./mmproj.gguf\n", files)
    assert "second FROM" in (err.value.hint or "")


def test_a_projector_for_another_width_is_refused(store, files):
    with pytest.raises(InvalidInput, match="makes 640-wide embeddings, but smol:latest reads 576"):
        _create(store, "bad", "FROM smol\nFROM ./wide-mmproj.gguf\n", files)
    assert not store.exists("bad")


def test_a_missing_projector_file_is_named(store, files):
    with pytest.raises(InvalidInput, match="vision projector file .*nowhere.gguf does not exist"):
        _create(store, "bad", "FROM smol\nFROM ./nowhere.gguf\n", files)


def test_uploaded_files_tell_the_projector_by_its_architecture(store, files):
    """Ollama's create(files=...): two GGUF blobs, the `clip` one is the projector whatever its file name."""
    weights = store.blobs.add_file(files / "smollm2.gguf")
    projector = store.blobs.add_file(files / "mmproj.gguf")
    request = api.CreateRequest(model="uploaded", files={"a.gguf": projector, "b.gguf": weights})
    _drain(create_model(request, store))
    model = store.resolve("uploaded")
    assert model.projector == store.blobs.path(projector)
    assert model.weights == store.blobs.path(weights)
    two = api.CreateRequest(model="bad", files={"a.gguf": projector, "b.gguf": projector, "c.gguf": weights})
    with pytest.raises(InvalidInput, match="1 model .gguf files and 2 vision projectors"):
        _drain(create_model(two, store))


def test_the_manifest_holds_one_projector_layer(store):
    (manifest,) = [p for p in store.manifests_dir.rglob("*") if p.is_file() and p.parent.name == "smolvlm"]
    layers = json.loads(manifest.read_text())["layers"]
    assert [layer["mediaType"] for layer in layers].count(MEDIA_PROJECTOR) == 1


def test_plan_counts_the_projector(store, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(store.root.parent))
    result = CliRunner().invoke(app, ["plan", "smolvlm", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    text_only = json.loads(CliRunner().invoke(app, ["plan", "smol", "--json"]).output)
    assert plan["projector"] > 0 and text_only["projector"] == 0
    assert plan["total"] == text_only["total"] + plan["projector"]


# ------------------------------------------------------------------------------------------------- serving images

VISION = "smolvlm"
OPTIONS = {"temperature": 0, "num_predict": 12, "num_ctx": 512, "num_thread": 1, "seed": 0}
# What mtmd wraps an idefics3 image in, looked up in the text model's vocabulary ("\n" is its byte token).
IDEFICS3_MARKERS = ("\n\n", "<fake_token_around_image>", "<global-img>", "<row_1_col_1>")
TINY_EMBD = 64  # tests/tiny_models.py's width


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height, with a few bytes of data: decoding it would take the memory
    of every pixel it declares."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision_home(models_home, files, tmp_path_factory) -> Path:
    """A private home with the catalog models and `smolvlm`: smollm2:135m with the LLaVA-style projector."""
    home = private_home(models_home, tmp_path_factory.mktemp("vision-home"))
    store = Store(home / "models")
    modelfile = "FROM smollm2:135m\nFROM ./mmproj.gguf\nPARAMETER spec_type none\n"
    _create(store, VISION, modelfile, files)
    _create(store, "smolvlm-wrapped", "FROM smollm2:135m\nFROM ./idefics3-mmproj.gguf\n", files)
    _create(store, "smolvlm-unknown", "FROM smollm2:135m\nFROM ./unknown-mmproj.gguf\n", files)
    _create(store, "tiny-smolvlm", "FROM ./tiny-smolvlm.gguf\nFROM ./tiny-idefics3-mmproj.gguf\n", files)
    return home


@pytest.fixture(scope="module")
def url(vision_home) -> Iterator[str]:
    os.environ["LOCALLLM_HOME"] = str(vision_home)  # the prefix cache's disk tier lives in the home
    with served(vision_home, LOCALLLM_NUM_PARALLEL="1") as base:
        yield base


def chat(url: str, content: str, images: list[str], model: str = VISION) -> httpx.Response:
    message = {"role": "user", "content": content, "images": images}
    body = {"model": model, "messages": [message], "stream": False, "options": OPTIONS}
    return httpx.post(f"{url}/api/chat", json=body, timeout=120)


def test_the_ollama_client_chats_about_an_image(url):
    reply = ollama.Client(host=url).chat(
        model=VISION,
        messages=[{"role": "user", "content": "What is in this image?", "images": [png()]}],
        options=OPTIONS,
    )
    assert reply.done and reply.message.content
    assert reply.prompt_eval_count > N_PATCHES  # the image's positions count as prompt tokens


def test_the_ollama_client_generates_about_an_image(url):
    reply = ollama.Client(host=url).generate(model=VISION, prompt="Describe it.", images=[png(1)], options=OPTIONS)
    assert reply.done and reply.response
    assert reply.context is None  # placeholders are no tokens a client could send back


def test_a_second_question_about_the_same_image_reuses_its_prefix(url):
    first = chat(url, "What is in this image?", [b64(png(2))]).json()
    again = chat(url, "Which colours are there?", [b64(png(2))]).json()
    other = chat(url, "Which colours are there?", [b64(png(3))]).json()
    # The same image: the cached prefix runs through the image's positions; another image stops before them.
    assert again["prompt_cache_count"] >= other["prompt_cache_count"] + N_PATCHES
    assert first["prompt_eval_count"] > 0


def error(reply: httpx.Response) -> str:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_a_model_without_a_projector_refuses_images_in_ollamas_words(url):
    assert "this model is missing data required for image input" in error(chat(url, "hi", [b64(png())], "smollm2:135m"))


def test_a_projector_mtmd_cannot_load_leaves_the_model_chatting_in_text(url):
    """A projector only another engine reads (Ollama's own, say) must not cost the model its text chats."""
    body = {"model": "smolvlm-unknown", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    assert httpx.post(f"{url}/api/chat", json=body | {"options": OPTIONS}, timeout=120).status_code == 200
    assert "missing data required for image input" in error(chat(url, "hi", [b64(png())], "smolvlm-unknown"))


def test_a_projector_whose_wrapper_tokens_the_model_lacks_is_refused(url):
    assert "special tokens this model's vocabulary lacks" in error(chat(url, "hi", [b64(png())], "smolvlm-wrapped"))


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("not base64 at all!", "image 1 of message 1 is not valid base64"),
        (b64(b"just some text, no image"), "is not an image localllm reads"),
        (b64(bomb_png(5000, 5000)), "5000x5000 = 25,000,000 pixels; the limit is 16,777,216 (checked before decoding)"),
        (b64(bomb_png(30000, 30000)), "declares more than 16,777,216 pixels"),
        (b64(png()[:60]), "could not be decoded"),
    ],
    ids=["bad base64", "unknown format", "bomb", "huge bomb", "truncated"],
)
def test_a_bad_image_is_a_400_that_says_why(url, image, says):
    assert says in error(chat(url, "hi", [image]))


def test_too_many_images_are_refused(url):
    assert "17 images; the limit is 16" in error(chat(url, "hi", [b64(png())] * 17))


def test_an_image_over_the_byte_limit_is_refused(url, monkeypatch):
    from localllm import media

    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 100)
    assert f"is {len(png()):,} bytes; the limit is 100" in error(chat(url, "hi", [b64(png())]))


def generate(url: str, prompt: str, images: list[str], truncate: bool = False, **options) -> httpx.Response:
    body = {"model": VISION, "prompt": prompt, "raw": True, "images": images, "stream": False, "truncate": truncate}
    return httpx.post(f"{url}/api/generate", json=body | {"options": OPTIONS | options}, timeout=120)


def test_an_image_that_does_not_fit_is_the_same_overflow_as_text(url):
    """Truncation is asked for, but a cut could fall inside an image: the prompt is refused whole."""
    text = "word " * 70
    plain = error(generate(url, text, [], num_ctx=64))
    assert generate(url, text, [], truncate=True, num_ctx=64).status_code == 200  # text alone is cut
    seen = error(generate(url, text, [b64(png())], num_ctx=64, truncate=True))
    n_plain, n_seen = (int(m.split("prompt is ")[1].split()[0]) for m in (plain, seen))
    assert n_seen == n_plain + N_PATCHES and "the context holds 64 per slot" in seen


def test_an_image_longer_than_a_batch_is_refused(url):
    assert f"an image takes {N_PATCHES} positions, more than num_batch 2" in error(
        generate(url, "Describe it.", [b64(png())], num_batch=2)
    )


def test_the_server_answers_after_the_refusals(url):
    assert chat(url, "What is in this image?", [b64(png())]).status_code == 200


NEAR_TIE = 0.1  # nats between the top two tokens within which another batch shape may flip the greedy pick


@pytest.mark.parametrize(
    ("model", "weights", "projector", "prompt"),
    [
        (VISION, "smollm2.gguf", "mmproj.gguf", "Describe this picture:"),
        ("tiny-smolvlm", "tiny-smolvlm.gguf", "tiny-idefics3-mmproj.gguf", "w1 w2"),
    ],
    ids=["llava", "idefics3"],
)
def test_answers_equal_llama_mtmd_cli(url, files, tmp_path, model, weights, projector, prompt):
    """The same weights, projector, image and prompt (raw: the template is the identity) through llama.cpp's own
    pipeline: the same greedy text, up to a near-tie. Random weights make near-ties, where llama-mtmd-cli's batch
    shapes may pick the runner-up: there the text may part, but only to our second choice. SmolVLM's idefics3
    layout has an overview and a tile per image, each wrapped in marker tokens of the text model's vocabulary."""
    binary = reference_tool("llama-mtmd-cli")
    image = tmp_path / "image.png"
    image.write_bytes(png(4))
    identity = "{% for m in messages %}{{ m.content }}{% endfor %}"
    generated = _mtmd_cli_answer(
        [binary, "-m", str(files / weights), "--mmproj", str(files / projector), "--image", str(image)]
        + ["-p", prompt, "-n", "12", "--temp", "0", "-t", "1", "-c", "512", "--no-warmup", "--jinja"]
        + ["--chat-template", identity]
    )
    body = {"model": model, "prompt": prompt, "raw": True, "images": [b64(png(4))], "stream": False}
    body |= {"options": OPTIONS, "logprobs": True, "top_logprobs": 2}
    ours = httpx.post(f"{url}/api/generate", json=body, timeout=120).json()
    compared = _same_text_up_to_a_near_tie(generated, ours["logprobs"])
    assert compared >= 2 or compared == len(ours["logprobs"])
    without = httpx.post(f"{url}/api/generate", json={**body, "images": []}, timeout=120).json()
    assert without["response"] != ours["response"]  # the image is read: the answer is not the text's alone


MTMD_CLI_ATTEMPTS = 8  # a busy machine lost some of the output in 13 of 60 runs: 8 runs all losing it is ~1e-5


def _mtmd_cli_answer(command: list[str]) -> str:
    """llama-mtmd-cli's answer, whole. Its output goes through a logger thread that the process leaves behind at
    exit without a flush (on purpose: ggml-org/llama.cpp#22142), so on a busy machine the tail, or all of it, can
    be lost. The whole output ends with the blank line printed after the answer; a run without it is run again."""
    for _ in range(MTMD_CLI_ATTEMPTS):
        reference = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert reference.returncode == 0, reference.stderr[-2000:]
        if reference.stdout.endswith("\n\n"):
            return reference.stdout.removeprefix("\n")[: -len("\n\n")]  # a newline once the prompt is read
    pytest.fail(f"llama-mtmd-cli lost its output's end in {MTMD_CLI_ATTEMPTS} runs: {reference.stdout!r}")


def _same_text_up_to_a_near_tie(theirs: str, ours: list[dict]) -> int:
    """How many of our tokens `theirs` (llama-mtmd-cli's output) repeats before it takes our runner-up at a near-tie;
    fails where it parts anywhere else."""
    at = 0
    for i, token in enumerate(ours):
        if theirs.startswith(token["token"], at):
            at += len(token["token"])
            continue
        first, second = token["top_logprobs"][:2]
        assert first["logprob"] - second["logprob"] < NEAR_TIE, f"token {i}: {theirs[at:]!r} against {ours[i:]}"
        assert theirs.startswith(second["token"], at), f"token {i}: {theirs[at:]!r} is not our runner-up {second}"
        return i
    return len(ours)


# ------------------------------------------------------------------------------------------------- other APIs

OPENAI_OPTIONS = {"temperature": 0, "max_tokens": 8, "seed": 0}


def data_uri(data: bytes) -> str:
    return f"data:image/png;base64,{b64(data)}"


def test_openai_chat_takes_an_image_url_data_uri(url):
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    content = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": data_uri(png(5))}},
    ]
    reply = oai.chat.completions.create(model=VISION, messages=[{"role": "user", "content": content}], **OPENAI_OPTIONS)
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.prompt_tokens > N_PATCHES


def test_openai_chat_refuses_a_remote_image_url(url):
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    content = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched") as err:
        oai.chat.completions.create(model=VISION, messages=[{"role": "user", "content": content}], **OPENAI_OPTIONS)
    assert "data: URI" in str(err.value)


def test_responses_take_an_input_image(url):
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    content = [{"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_uri(png(6))}]
    reply = oai.responses.create(
        model=VISION, input=[{"role": "user", "content": content}], temperature=0, max_output_tokens=8
    )
    assert reply.usage is not None and reply.usage.input_tokens > N_PATCHES


def test_anthropic_messages_take_a_base64_image(url):
    claude = anthropic.Anthropic(base_url=url, api_key="unused")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png(7))}}
    reply = claude.messages.create(
        model=VISION,
        max_tokens=8,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}],
    )
    assert reply.usage.input_tokens > N_PATCHES
    by_url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    with pytest.raises(anthropic.BadRequestError, match="never fetches a URL"):
        claude.messages.create(model=VISION, max_tokens=8, messages=[{"role": "user", "content": [by_url]}])


# ------------------------------------------------------------------------------------------------- terminal chat


class ScriptedLines:
    """The chat's line reader, reading from a list; then Ctrl-D."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines)

    def __call__(self, prompt: str) -> str:
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)

    def take_interrupt(self) -> bool:
        return False

    def keep_history(self, enabled: bool) -> None:
        pass


def test_the_terminal_chat_attaches_an_image_with_slash_image(vision_home, tmp_path, capsys):
    from server_harness import local_client

    from localllm.cli.repl import Repl
    from localllm.conversation import Conversation

    image = tmp_path / "photo.png"
    image.write_bytes(png(8))
    (tmp_path / "notes.txt").write_text("no image")
    lines = [f"/image {tmp_path / 'nowhere.png'}", f"/image {tmp_path / 'notes.txt'}", f"/image {image}", "What is it?"]
    client = local_client(vision_home)
    try:
        conversation = Conversation(model=VISION, options=dict(OPTIONS))
        repl = Repl(client, conversation, reader=ScriptedLines(lines))
        repl.run()
    finally:
        client.close()
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())  # rich wraps lines at the terminal's width
    assert "no image file at" in out and "is not an image localllm reads" in out
    assert "Added image" in out and "1 for the next message" in out
    asked, answer = conversation.messages
    assert asked.images == [b64(png(8))] and answer.role == "assistant"
    assert repl.images == []  # sent with that message, not with the next


def chat_in_terminal(home: Path, lines: list[str], model: str = VISION):
    """The terminal chat over `lines` with `model`; its conversation and what it printed (unwrapped)."""
    from server_harness import local_client

    from localllm.cli.repl import Repl
    from localllm.conversation import Conversation

    client = local_client(home)
    try:
        conversation = Conversation(model=model, options=dict(OPTIONS))
        Repl(client, conversation, reader=ScriptedLines(lines)).run()
    finally:
        client.close()
    return conversation


def printed(capsys) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())  # rich wraps lines at the terminal's width


def test_an_image_path_in_a_message_goes_with_it(vision_home, tmp_path, capsys):
    """As in Ollama's chat: a quoted path with a space is read, sent as the message's image and taken out of its
    text; the answer's prompt counts the image's positions."""
    image = tmp_path / "my photo.png"
    image.write_bytes(png(10))
    conversation = chat_in_terminal(vision_home, [f"Describe '{image}' in a word."])
    asked, answer = conversation.messages
    assert (asked.content, asked.images) == ("Describe in a word.", [b64(png(10))])
    assert answer.role == "assistant"
    assert conversation.figures.last is not None and conversation.figures.last.prompt_eval_count > N_PATCHES
    assert f"Added image '{image}'" in printed(capsys)


def test_a_message_may_open_with_image_paths(vision_home, tmp_path, monkeypatch, capsys):
    """A line starting with an absolute path is a message, not an unknown command; an escaped space and a path
    relative to the working directory are read too, in the order typed."""
    (tmp_path / "my photo.png").write_bytes(png(11))
    (tmp_path / "cat.png").write_bytes(png(12))
    monkeypatch.chdir(tmp_path)
    escaped = str(tmp_path / "my photo.png").replace(" ", "\\ ")
    conversation = chat_in_terminal(vision_home, [f"{escaped} cat.png Which is brighter?"])
    asked, _ = conversation.messages
    assert (asked.content, asked.images) == ("Which is brighter?", [b64(png(11)), b64(png(12))])
    assert "unknown command" not in printed(capsys)


def test_a_path_to_no_file_stays_text_and_a_file_that_is_no_image_is_refused(vision_home, tmp_path, capsys):
    notes = tmp_path / "notes.png"
    notes.write_text("no image, whatever its name says")
    missing = f"Rename it to {tmp_path / 'final.png'}, please."
    conversation = chat_in_terminal(vision_home, [f"What is in {notes}?", missing])
    assert f"{notes} is not an image localllm reads" in printed(capsys)
    asked, _ = conversation.messages  # the refused message was not sent
    assert (asked.content, asked.images) == (missing, None)


def test_a_model_without_vision_keeps_the_path_as_text(vision_home, tmp_path, capsys):
    image = tmp_path / "photo.png"
    image.write_bytes(png(13))
    conversation = chat_in_terminal(vision_home, [f"Describe {image}"], model="smollm2:135m")
    asked, _ = conversation.messages
    assert (asked.content, asked.images) == (f"Describe {image}", None)
    assert "Added image" not in printed(capsys)


# ------------------------------------------------------------------------------------------------- reference

REFERENCE_EMBEDDINGS = """
import ctypes, sys
import llama_cpp
import numpy as np
from llama_cpp import mtmd_cpp as m

text, projector, image, out = sys.argv[1:]
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(text.encode(), llama_cpp.llama_model_default_params())
params = m.mtmd_context_params_default()
params.n_threads, params.warmup = 1, False
ctx = m.mtmd_init_from_file(projector.encode(), model, params)
bitmap = m.mtmd_helper_bitmap_init_from_file(ctx, image.encode(), False)  # mtmd decodes the file itself
chunks = m.mtmd_input_chunks_init()
marker = m.mtmd_default_marker()
prompt = m.mtmd_input_text()
prompt.text, prompt.text_len, prompt.add_special, prompt.parse_special = marker, len(marker), False, True
assert m.mtmd_tokenize(ctx, chunks, ctypes.byref(prompt), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
rows = []
for i in range(m.mtmd_input_chunks_size(chunks)):
    chunk = m.mtmd_input_chunks_get(chunks, i)
    if m.mtmd_input_chunk_get_type(chunk) == 1:
        n = m.mtmd_input_chunk_get_n_tokens(chunk)
        assert m.mtmd_encode_chunk(ctx, chunk) == 0
        embd = m.mtmd_get_output_embd(ctx)
        rows.append(np.ctypeslib.as_array(embd, shape=(n * 576,)).reshape(n, 576).copy())
np.save(out, np.concatenate(rows))
"""


def test_image_embeddings_equal_mtmds_own_pipeline(files, smollm2_path, tmp_path):
    """Our pixels (Pillow's decode, bounded first) through our Projector give the embeddings llama.cpp's mtmd
    gives when it reads the same PNG itself (stb_image), computed in a child process."""
    import llama_cpp

    from localllm.backends.llama_cpp.backend import init_backend
    from localllm.backends.llama_cpp.vision import Projector
    from localllm.media import PromptImage, decode_image

    image = tmp_path / "image.png"
    image.write_bytes(png(9))
    out = tmp_path / "reference.npy"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            REFERENCE_EMBEDDINGS,
            str(smollm2_path),
            str(files / "mmproj.gguf"),
            str(image),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    init_backend()
    model = llama_cpp.llama_model_load_from_file(str(smollm2_path).encode(), llama_cpp.llama_model_default_params())
    projector = Projector(files / "mmproj.gguf", model, n_threads=1, n_embd=576)
    try:
        pixels = decode_image(image.read_bytes())
        placeholders = tuple(t for t in projector.image_tokens(pixels) if t < 0)
        projector.encode_image(PromptImage(pixels, placeholders))
        ours = projector.rows(list(placeholders))
    finally:
        projector.close()
        llama_cpp.llama_model_free(model)
    reference = np.load(out)
    assert ours.shape == reference.shape == (N_PATCHES, 576)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)
