"""The model manager's issue-18 features on the real engine and smollm2:135m: LoRA adapters applied at load,
quantization through llama.cpp with its quality report, split GGUFs pulled from the loopback hub, and weights shared
between models over the same blob. Edge-case files (adapters, F16 weights, split parts) are written here with the
`gguf` package."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localllm import api
from localllm.errors import InvalidInput, LocalLLMError, ModelFormatError
from localllm.models.create import create_model
from localllm.models.store import Store

pytestmark = pytest.mark.models

GREEDY = {"temperature": 0, "num_predict": 12, "num_ctx": 256, "num_parallel": 1, "spec_type": "none"}
PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def no_cpu_repack(monkeypatch):
    # This llama.cpp build crashes in its AMX repacked matmul on our machines (any model, any thread count).
    monkeypatch.setenv("LOCALLLM_CPU_REPACK", "0")


def _drain(stream) -> list[api.PullProgress]:
    return list(stream)


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2_path) -> Store:
    """A store holding smollm2:135m as `smol` (its blob copied once for the module)."""
    home = tmp_path_factory.mktemp("home")
    (home / "smollm2.gguf").symlink_to(smollm2_path)
    store = Store(home / "models")
    _drain(create_model(api.CreateRequest(model="smol", **{"from": str(home / "smollm2.gguf")}), store))
    return store


@pytest.fixture(scope="module")
def client(store):
    from localllm.client.local import LocalClient

    client = LocalClient(store)
    yield client
    client.close()


def _answer(client, model: str, **options) -> str:
    request = api.GenerateRequest(model=model, prompt=PROMPT, raw=True, stream=False, options={**GREEDY, **options})
    return "".join(chunk.response for chunk in client.generate(request))


# ---------------------------------------------------------------------------------------------------------- LoRA

def write_lora(path: Path, *, n_embd: int = 576, layers: int = 6, rank: int = 4, arch: str = "llama",
               seed: int = 0, **overrides) -> Path:
    """A LoRA adapter as convert_lora_to_gguf.py writes one: general.type adapter, adapter.type lora, an alpha, and
    `<tensor>.lora_a` [rank x n_in] / `.lora_b` [n_out x rank] pairs (numpy order) for square attention tensors."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", overrides.get("general_type", "adapter"))
    writer.add_string("adapter.type", overrides.get("adapter_type", "lora"))
    writer.add_float32("adapter.lora.alpha", float(rank))
    for layer in range(layers):
        for name in ("attn_q", "attn_output"):
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a",
                              rng.normal(0, 0.2, (rank, n_embd)).astype(np.float32))
            if not overrides.get("drop_b"):
                writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b",
                                  rng.normal(0, 0.2, (n_embd, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory) -> Path:
    return write_lora(tmp_path_factory.mktemp("lora") / "lora.gguf")


def _create_from_modelfile(store, name: str, text: str, base: Path) -> None:
    _drain(create_model(api.CreateRequest(model=name, modelfile=text), store, base_dir=base))


def test_a_lora_adapter_changes_greedy_output_and_scale_zero_leaves_it(store, client, lora_path):
    _create_from_modelfile(store, "smol-lora", "FROM smol\nADAPTER ./lora.gguf\n", lora_path.parent)
    _create_from_modelfile(store, "smol-lora-off", "FROM smol\nADAPTER ./lora.gguf 0\n", lora_path.parent)
    plain = _answer(client, "smol")
    adapted = _answer(client, "smol-lora")
    assert adapted != plain
    assert _answer(client, "smol-lora-off") == plain
    assert _answer(client, "smol-lora", adapter_scale=0) == plain  # the option overrides the ADAPTER line's scale
    shown = client.show("smol-lora-off")
    assert [a.scale for a in shown.adapters] == [0.0]
    assert any(line.startswith("ADAPTER ") and line.endswith(" 0") for line in shown.modelfile.splitlines())


@pytest.mark.parametrize("kind", ["text", "model", "unpaired"])
def test_a_file_that_is_not_a_gguf_lora_is_refused_and_never_stored(store, tmp_path, smollm2_path, kind):
    bad = tmp_path / "adapter.gguf"
    if kind == "text":
        bad.write_text("this is not a GGUF file at all\n")
    elif kind == "model":
        bad.symlink_to(smollm2_path)  # a GGUF, but a model, not an adapter
    else:
        write_lora(bad, drop_b=True)
    blobs = set(store.blobs_dir.iterdir())
    with pytest.raises(ModelFormatError) as caught:
        _create_from_modelfile(store, "smol-bad", "FROM smol\nADAPTER ./adapter.gguf\n", tmp_path)
    assert caught.value.status_code == 400
    assert {"text": "GGUF", "model": "not a LoRA adapter", "unpaired": "lacks its lora_a or lora_b"}[kind] \
        in str(caught.value)
    assert set(store.blobs_dir.iterdir()) == blobs
    assert not store.exists("smol-bad")


def test_an_adapter_for_another_architecture_is_refused(store, tmp_path):
    write_lora(tmp_path / "gemma.gguf", arch="gemma3")
    with pytest.raises(InvalidInput, match="gemma3"):
        _create_from_modelfile(store, "smol-gemma-lora", "FROM smol\nADAPTER ./gemma.gguf\n", tmp_path)


def test_adapters_count_in_the_plan(store, lora_path, monkeypatch):
    from typer.testing import CliRunner

    from localllm.cli import app

    _create_from_modelfile(store, "smol-lora-plan", "FROM smol\nADAPTER ./lora.gguf 0.5\n", lora_path.parent)
    monkeypatch.setenv("LOCALLLM_HOME", str(store.root.parent))
    result = CliRunner().invoke(app, ["plan", "smol-lora-plan", "--json"])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)
    assert planned["adapters"] == 6 * 2 * 2 * 4 * 576 * 4  # layers x tensors x (a, b) x rank x n_embd x f32
    assert planned["total"] == planned["weights"] + planned["adapters"] + planned["kv_total"] + planned["compute"]


def test_adapters_are_refused_on_mlx(store, client, lora_path):
    request = api.CreateRequest(model="smol-mlx-lora", format="mlx", modelfile="FROM smol\nADAPTER ./lora.gguf\n")
    with pytest.raises(InvalidInput, match="not supported on the MLX backend"):
        _drain(create_model(request, store, base_dir=lora_path.parent))
    _create_from_modelfile(store, "smol-lora-mlx", "FROM smol\nADAPTER ./lora.gguf\n", lora_path.parent)
    with pytest.raises(InvalidInput, match="not supported on the MLX backend"):
        _answer(client, "smol-lora-mlx", backend="mlx")
