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
def test_kv_cache_matches_llama_cpp(smollm2_path):
    info = inspect_gguf(smollm2_path)
    plan = plan_memory(info, _load())
    # llama.cpp logs "KV buffer size = 180.00 MiB" for smollm2 with 2 slots x 4096 cells in f16:
    # 30 layers x 3 KV heads x (64 + 64) x 2 bytes per token.
    assert plan.kv_total == 180 * MIB
    assert plan.kv_per_slot * 2 == plan.kv_total
    assert plan.weights == info.tensor_bytes
    assert plan.total == plan.weights + plan.kv_total + plan.compute


@pytest.mark.models
def test_plan_scales_with_slots_context_and_kv_type(smollm2_path):
    info = inspect_gguf(smollm2_path)
    base = plan_memory(info, _load())
    assert plan_memory(info, _load(num_parallel=4)).kv_total == 2 * base.kv_total
    assert plan_memory(info, _load(num_ctx=2048)).kv_per_slot == base.kv_per_slot // 2
    assert plan_memory(info, _load(kv_type="q8_0")).kv_per_slot < base.kv_per_slot
    assert plan_memory(info, _load(kv_type="q4_0")).kv_per_slot < plan_memory(info, _load(kv_type="q8_0")).kv_per_slot


@pytest.mark.models
def test_plan_command(models_home, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(models_home))
    result = CliRunner().invoke(app, ["plan", "smollm2:135m", "--num-ctx", "4096", "--num-parallel", "2"])
    assert result.exit_code == 0, result.output
    assert "180.0 MiB" in result.output and "2 slots x 4096 tokens" in result.output
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
    monkeypatch.delenv("LOCALLLM_CACHE_DISK")
    plain = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "smollm2:135m", "--json"])
    assert '"cache_ram_limit": 0' in plain.output and '"cache_disk_limit": 0' in plain.output
