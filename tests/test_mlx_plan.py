"""`plan` for MLX models: the weights as the MLX backend holds them (float tensors cast to float32 on the CPU build),
and a KV cache per sequence of layers x kv heads x head dim, in the float type or mlx-lm's quantized groups.

Runs on a tiny random llama written in float16 (as test_mlx_backend builds it), stored as an MLX model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from test_mlx_backend import _write_tiny_llama  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from localllm.cli import app  # noqa: E402
from localllm.models.store import Store  # noqa: E402
from localllm.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.mlx

# Two layers, one KV head of 64: mlx-lm quantizes such heads in groups of 64.
SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture
def tiny_mlx(tmp_path) -> Path:
    """The tiny llama stored as the MLX model tiny-mlx; returns its folder as written."""
    folder = tmp_path / "tiny-mlx"
    _write_tiny_llama(folder, **SHAPE)
    store = Store()
    weights = {p.name: store.blobs.add_file(p) for p in sorted(folder.iterdir())}
    store.write_model("tiny-mlx", weights=weights, fmt="mlx")
    return folder


def _plan(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", "tiny-mlx", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _tensor_bytes(folder: Path) -> int:
    """The safetensors files' sizes less their headers (8 bytes of length, then the JSON)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        header = int.from_bytes(path.read_bytes()[:8], "little")
        total += path.stat().st_size - 8 - header
    return total


def test_weights_are_the_files_tensors_as_the_backend_holds_them(tiny_mlx):
    assert mx.default_device().type == mx.cpu  # the CPU build: float16 weights load as float32
    row = _plan("--num-ctx", "256", "--num-parallel", "3")
    assert row["weights"] == 2 * _tensor_bytes(tiny_mlx) > 0
    assert row["adapters"] == 0 and row["projector"] == 0


def test_kv_cache_is_layers_by_kv_heads_by_head_dim_per_sequence(tiny_mlx):
    row = _plan("--num-ctx", "256", "--num-parallel", "3")
    layers, kv_heads, head_dim = 2, 1, 128 // 2
    per_token = layers * kv_heads * head_dim * 2 * 4  # K and V, float32 on the CPU build
    assert row["kv_per_token"] == per_token
    assert row["kv_per_slot"] == per_token * 256
    # Each MLX sequence has its own cache: the slots share no pool.
    assert row["kv_cells"] == 256 * 3 and row["kv_total"] == per_token * 256 * 3
    assert row["total"] == row["weights"] + row["kv_total"] + row["compute"]


def test_quantized_kv_plans_less_than_full(tiny_mlx):
    full = _plan("--num-ctx", "256", "--kv-type", "f16")
    q8 = _plan("--num-ctx", "256", "--kv-type", "q8_0")
    q4 = _plan("--num-ctx", "256", "--kv-type", "q4_0")
    elements = 2 * 1 * 64 * 2
    # mx.quantize's packed bits, plus a float32 scale and bias per group of 64.
    assert q8["kv_per_token"] == int(elements * (8 / 8 + 2 * 4 / 64))
    assert q4["kv_per_token"] == int(elements * (4 / 8 + 2 * 4 / 64))
    assert q4["kv_total"] < q8["kv_total"] < full["kv_total"]
    assert q4["weights"] == full["weights"] and q4["kv_type"] == "q4_0"


def test_plan_command_shows_the_table(tiny_mlx):
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["plan", "tiny-mlx", "--num-ctx", "256", "--num-parallel", "3", "--kv-type", "q4_0"]
    )
    assert result.exit_code == 0, result.output
    assert "tiny-mlx:latest: 3 slots x 256 tokens, KV q4_0" in result.output
    assert f"KV cache per token ({int(256 * (4 / 8 + 2 * 4 / 64))} bytes)" in result.output


def test_the_table_names_the_caches_mlx_keeps(tiny_mlx):
    """No pool the slots share and no f16 cache: a cache per slot, in the float32 the CPU build computes in."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["plan", "tiny-mlx", "--num-ctx", "256", "--num-parallel", "3"]
    )
    assert result.exit_code == 0, result.output
    assert "tiny-mlx:latest: 3 slots x 256 tokens, KV f32" in result.output
    assert "KV caches, one per slot (3 x 256 tokens)" in result.output and "KV pool" not in result.output
    assert _plan("--num-ctx", "256")["kv_pooled"] is False


def test_api_plan_answers_the_same_for_mlx(tiny_mlx):
    cli = _plan("--num-ctx", "512", "--num-parallel", "2", "--kv-type", "q8_0")
    with TestClient(create_app(), base_url="http://127.0.0.1") as http:
        response = http.post(
            "/api/plan", json={"model": "tiny-mlx", "options": {"num_ctx": 512, "num_parallel": 2, "kv_type": "q8_0"}}
        )
    assert response.status_code == 200, response.text
    (row,) = response.json()["models"]
    same = ("weights", "kv_per_token", "kv_total", "compute", "num_ctx", "num_parallel", "kv_type")
    assert {k: row[k] for k in same} == {k: cli[k] for k in same}
    assert row.get("placement") is None  # one device, unified memory: nothing to place


def test_a_config_without_the_attention_shape_is_a_clear_error(tiny_mlx):
    store = Store()
    config = json.loads((store.resolve("tiny-mlx").weights / "config.json").read_text())
    del config["num_attention_heads"]
    broken = tiny_mlx.parent / "broken"
    broken.mkdir()
    for p in tiny_mlx.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    (broken / "config.json").write_text(json.dumps(config))
    weights = {p.name: store.blobs.add_file(p) for p in sorted(broken.iterdir())}
    store.write_model("broken-mlx", weights=weights, fmt="mlx")
    result = CliRunner().invoke(app, ["plan", "broken-mlx"])
    assert result.exit_code == 1
    assert "config.json lacks the attention shape" in result.output and "num_attention_heads" in result.output
