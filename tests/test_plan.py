"""The memory plan, read from GGUF metadata before loading, against the sizes llama.cpp itself reports."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from localllm.api import LoadOptions
from localllm.cli import app
from localllm.models.plan import plan_memory
from localllm.quant.gguf import inspect_gguf

MIB = 2**20


def _load(**kw) -> LoadOptions:
    return LoadOptions(**{"num_ctx": 4096, "num_parallel": 2, "kv_type": "f16", **kw})


@pytest.mark.models
def test_kv_cache_matches_llama_cpp(smollm2_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_KV_POOL", "8192")
    info = inspect_gguf(smollm2_path)
    plan = plan_memory(info, _load())
    # llama.cpp logs "KV buffer size = 180.00 MiB" for smollm2 with 8192 cells in f16 (2 slots x 4096):
    # 30 layers x 3 KV heads x (64 + 64) x 2 bytes per token.
    assert plan.kv_total == 180 * MIB and plan.kv_cells == 8192
    assert plan.kv_per_slot * 2 == plan.kv_total
    assert plan.weights == info.tensor_bytes
    assert plan.total == plan.weights + plan.kv_total + plan.compute


@pytest.mark.models
def test_the_slots_share_one_pool_of_a_slots_context_by_default(smollm2_path, monkeypatch):
    """As llama-server's unified cache for the same context: more slots draw from the same cells."""
    info = inspect_gguf(smollm2_path)
    base = plan_memory(info, _load())
    assert base.kv_total == base.kv_per_slot == 90 * MIB and base.kv_cells == 4096
    assert plan_memory(info, _load(num_parallel=4)).kv_total == base.kv_total
    monkeypatch.setenv("LOCALLLM_KV_POOL", "12288")
    assert plan_memory(info, _load(num_parallel=4)).kv_total == 3 * base.kv_total
    assert plan_memory(info, _load(num_parallel=2)).kv_cells == 8192  # never more than every slot's context
    monkeypatch.setenv("LOCALLLM_KV_POOL", "100")
    assert plan_memory(info, _load()).kv_cells == 4096  # never less than one slot's


@pytest.mark.models
def test_plan_scales_with_context_and_kv_type(smollm2_path):
    info = inspect_gguf(smollm2_path)
    base = plan_memory(info, _load())
    assert plan_memory(info, _load(num_ctx=2048)).kv_per_slot == base.kv_per_slot // 2
    assert plan_memory(info, _load(num_ctx=2048)).kv_total == base.kv_total // 2
    assert plan_memory(info, _load(kv_type="q8_0")).kv_per_slot < base.kv_per_slot
    assert plan_memory(info, _load(kv_type="q4_0")).kv_per_slot < plan_memory(info, _load(kv_type="q8_0")).kv_per_slot


@pytest.mark.models
def test_plan_command(models_home, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(models_home))
    result = CliRunner().invoke(app, ["plan", "smollm2:135m", "--num-ctx", "4096", "--num-parallel", "2"])
    assert result.exit_code == 0, result.output
    assert "90.0 MiB" in result.output and "2 slots x 4096 tokens" in result.output
    assert "KV pool the 2 slots share (4,096 tokens" in result.output
    bad = CliRunner().invoke(app, ["plan", "smollm2:135m", "--kv-type", "q3"])
    assert bad.exit_code == 1 and "kv_type" in bad.output


@pytest.mark.models
def test_plan_shows_the_prefix_cache_limits(models_home, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(models_home))
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "512MiB")
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "2GiB")
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "smollm2:135m"])
    assert result.exit_code == 0, result.output
    assert "prefix cache in RAM" in result.output and "512.0 MiB" in result.output
    assert "prefix cache on disk" in result.output and "2,048.0 MiB" in result.output
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "0")
    plain = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "smollm2:135m", "--json"])
    assert '"cache_ram_limit": 0' in plain.output and '"cache_disk_limit": 0' in plain.output
    monkeypatch.delenv("LOCALLLM_CACHE_DISK")  # by default the disk tier is on, a bounded share of the free disk
    default = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "smollm2:135m"])
    assert "prefix cache on disk" in default.output
