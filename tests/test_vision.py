"""Vision models (issue 31): a model stored with a vision projector, a `clip` GGUF given by a second FROM (Ollama's
way) or uploaded beside the weights, shown with the `vision` capability and counted by `localllm plan`. The projector
is the synthetic idefics3 one of tests/vision_model.py, over smollm2:135m's embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from localllm import api
from localllm.cli.app import app
from localllm.errors import InvalidInput, ModelfileError, ModelFormatError
from localllm.models.create import create_model
from localllm.models.info import show_model
from localllm.models.modelfile import parse_modelfile, render_modelfile
from localllm.models.store import MEDIA_PROJECTOR, Store
from tests.vision_model import write_projector

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
    assert shown.projector_info["clip.projector_type"] == "idefics3"
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
