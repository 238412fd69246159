"""The model commands through the real typer app (CliRunner), and one pull killed with SIGKILL in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hfserver import Hub, HubServer, write_tiny_gguf
from typer.testing import CliRunner

from localllm import api
from localllm.cli import app
from localllm.models.modelfile import parse_modelfile
from localllm.models.store import Store

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def tiny(tmp_path, isolated_home) -> Path:
    """A tiny GGUF stored as `tiny:latest` through `localllm pull PATH`."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert invoke("pull", str(path)).exit_code == 0
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


# ------------------------------------------------------------------------------------------------------- catalog


@pytest.mark.models
def test_catalog_models_pull_list_and_show(models_home, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(models_home))
    again = invoke("pull", "smollm2:135m")
    assert again.exit_code == 0 and again.output.splitlines() == ["pulling manifest", "success"]
    listing = invoke("list").output
    assert "smollm2:135m" in listing and "gemma3:270m" in listing and "98 MB" in listing
    smol = invoke("show", "smollm2:135m").output
    assert "llama" in smol and "Q4_1" in smol and "<|im_start|>" in smol and "8192" in smol
    gemma = invoke("show", "gemma3:270m").output
    assert "gemma3" in gemma and "Q4_K_M" in gemma


@pytest.mark.models
def test_show_json_is_a_show_response_with_the_weights_path(models_home, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(models_home))
    show = api.ShowResponse.model_validate_json(invoke("show", "smollm2:135m", "--json").output)
    assert Path(show.path).is_file() and show.details.quantization_level == "Q4_1"
    assert show.model_info["general.architecture"] == "llama" and "<|im_start|>" in show.template
    listed = api.ListResponse.model_validate_json(invoke("list", "--json").output)
    assert {m.name for m in listed.models} >= {"smollm2:135m", "gemma3:270m"}


# ------------------------------------------------------------------------------------------------------- list, show


def test_list_of_an_empty_store(isolated_home):
    assert api.ListResponse.model_validate_json(invoke("list", "--json").output).models == []
    assert "NAME" in invoke("list").output


def test_ls_catalog_lists_what_pull_fetches_and_what_is_pulled(isolated_home, tiny):
    import json

    from localllm.models.catalog import CATALOG

    Store().copy("tiny", "nomic-embed-text:v1.5")  # stands in for a pulled catalog model
    rows = {row["name"]: row for row in json.loads(invoke("ls", "--catalog", "--json").output)}
    assert list(rows) == [entry.name for entry in CATALOG]
    assert rows["nomic-embed-text:v1.5"]["pulled"] and not rows["smollm2:135m"]["pulled"]
    assert rows["qwen2.5-coder:1.5b"]["license"] == "Apache-2.0" and rows["qwen2.5-coder:1.5b"]["size"] > 10**9
    table = invoke("ls", "--catalog").output
    assert "qwen2.5-coder:0.5b" in table and "nomic-embed-text:v1.5" in table and "LICENSE" in table
    missing = invoke("pull", "nosuch:1b")
    assert missing.exit_code != 0 and "ls --catalog" in missing.output


def test_show_of_a_tiny_model_and_its_single_fields(tiny):
    output = invoke("show", "tiny").output
    assert "llama" in output and "256" in output
    assert invoke("show", "tiny", "--license").output.strip() == "mit"
    assert "<|im_start|>" in invoke("show", "tiny", "--template").output


# ------------------------------------------------------------------------------------------------------- create


def test_create_from_a_gguf_next_to_the_modelfile(tmp_path, isolated_home, monkeypatch):
    folder = tmp_path / "project"
    write_tiny_gguf(folder / "weights" / "w.gguf")
    (folder / "Modelfile").write_text(
        'FROM ./weights/w.gguf\nSYSTEM "Be brief."\nPARAMETER temperature 0.3\n'
        'PARAMETER stop "<|im_end|>"\nMESSAGE user hi\nLICENSE "custom"\n'
    )
    monkeypatch.chdir(tmp_path)  # the FROM path is relative to the Modelfile, not to the working directory
    result = invoke("create", "me/brief:v1", "-f", str(folder / "Modelfile"))
    assert result.exit_code == 0 and result.output.splitlines()[-1] == "success"
    show = api.ShowResponse.model_validate_json(invoke("show", "me/brief:v1", "--json").output)
    assert show.system == "Be brief." and show.license == "custom"
    assert "temperature" in show.parameters and '"<|im_end|>"' in show.parameters
    rebuilt = parse_modelfile(invoke("show", "me/brief:v1", "--modelfile").output)
    assert rebuilt.system == "Be brief." and rebuilt.parameters == {"temperature": 0.3, "stop": ["<|im_end|>"]}
    assert rebuilt.from_ == "me/brief:v1"  # the model itself, so `create -f` takes the file as it is


def test_create_from_a_stored_model_inherits_and_overrides(tiny, tmp_path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM tiny\nSYSTEM parent\nPARAMETER temperature 0.5\nPARAMETER top_k 7\n")
    assert invoke("create", "parent", "-f", str(modelfile)).exit_code == 0
    modelfile.write_text("FROM parent\nPARAMETER temperature 0.1\nDRAFT tiny\n")
    assert invoke("create", "child", "-f", str(modelfile)).exit_code == 0
    child = Store().resolve("child")
    assert child.system == "parent" and child.parameters == {"temperature": 0.1, "top_k": 7}
    assert child.draft == "tiny:latest" and child.details.parent_model == "parent:latest"
    assert child.weights == Store().resolve("tiny").weights  # the weights blob is shared, not copied


@pytest.mark.parametrize(
    "modelfile, message",
    [
        ("FROM tiny\nFROB x\n", "Modelfile line 2"),
        ("FROM tiny\nPARAMETER nonsense 1\n", "Modelfile line 2"),
        ("FROM ./missing.gguf\n", "no GGUF file at"),
        ("FROM ../../etc\n", "not valid"),
    ],
)
def test_create_errors_are_one_line_and_store_nothing(tiny, tmp_path, modelfile, message):
    (tmp_path / "Modelfile").write_text(modelfile)
    before = _tree(Store().root)
    result = invoke("create", "new", "-f", str(tmp_path / "Modelfile"))
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert _tree(Store().root) == before


def test_create_with_quantize_of_a_model_llama_cpp_cannot_read_says_why_and_stores_nothing(tiny, tmp_path):
    (tmp_path / "Modelfile").write_text("FROM tiny\n")
    before = _tree(Store().root)
    result = invoke("create", "q", "-f", str(tmp_path / "Modelfile"), "--quantize", "q4_0")
    assert result.exit_code == 1 and "could not quantize to Q4_0: key not found" in result.output
    assert not Store().exists("q") and _tree(Store().root) == before


def test_create_without_a_modelfile(isolated_home, tmp_path):
    result = invoke("create", "x", "-f", str(tmp_path / "nope"))
    assert result.exit_code == 1 and "no Modelfile" in result.output


# ------------------------------------------------------------------------------------------------------- rm, cp, verify


def test_cp_then_rm(tiny):
    assert invoke("cp", "tiny", "me/copy:v2").output.strip() == "copied 'tiny:latest' to 'me/copy:v2'"
    assert "me/copy:v2" in invoke("list").output
    assert invoke("rm", "tiny", "me/copy:v2").exit_code == 0
    assert Store().list() == [] and not any(Store().blobs.dir.iterdir())


def test_rm_with_one_unknown_name_removes_nothing(tiny):
    result = invoke("rm", "tiny", "ghost")
    assert result.exit_code == 1 and "ghost" in result.output
    assert Store().exists("tiny")


def test_verify_reports_a_corrupt_blob(tiny):
    assert invoke("verify").exit_code == 0
    blob = Store().resolve("tiny").weights
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x01")
    result = invoke("verify", "tiny")
    assert result.exit_code == 1 and blob.name in result.output and "corrupt" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ("pull", "../../etc/passwd"),
        ("show", "../x"),
        ("rm", "a/../../b"),
        ("cp", "tiny", "/abs"),
        ("cp", "tiny", "bad name"),
        ("verify", "x" * 300),
        ("pull", "hf.co/org"),
        ("show", "sha256-zz/.."),
    ],
)
def test_invalid_names_are_one_line_errors_that_change_nothing(tiny, args):
    before = _tree(Store().root)
    result = invoke(*args)
    assert result.exit_code == 1
    assert result.output.startswith("Error:") and len(result.output.strip().splitlines()) == 1
    assert _tree(Store().root) == before


def test_show_of_an_unknown_model_hints_at_pull(isolated_home):
    result = invoke("show", "smollm2:135m")
    assert result.exit_code == 1 and "localllm pull smollm2:135m" in result.output


# ------------------------------------------------------------------------------------------------------- SIGKILL


@pytest.mark.slow
def test_a_pull_killed_halfway_resumes_and_verifies(tmp_path, isolated_home, monkeypatch):
    data = write_tiny_gguf(tmp_path / "big.gguf", pad_floats=1_000_000).read_bytes()  # about 4 MB
    hub = Hub(repos={"org/big-GGUF": {"big.Q8_0.gguf": data}}, delay=0.05, chunk=32 * 1024)
    with HubServer(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        env = dict(os.environ, LOCALLLM_HOME=str(isolated_home), HF_ENDPOINT=url)
        child = subprocess.Popen(
            [sys.executable, "-m", "localllm", "pull", "hf.co/org/big-GGUF:Q8_0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        partial = _wait_for_partial(Store().blobs.dir, at_least=512 * 1024, child=child)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        received = partial.stat().st_size
        assert 0 < received < len(data) and Store().list() == []
        hub.delay = 0.0
        result = invoke("pull", "hf.co/org/big-GGUF:Q8_0")
        assert result.exit_code == 0, result.output
    start = int(hub.ranges()[-1].removeprefix("bytes=").rstrip("-"))
    assert start >= received  # the second pull asked only for the bytes it lacked
    assert Store().resolve("hf.co/org/big-GGUF:Q8_0").weights.read_bytes() == data
    assert invoke("verify").exit_code == 0 and not partial.exists()


def _wait_for_partial(blobs: Path, *, at_least: int, child: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for path in blobs.glob("*-partial") if blobs.exists() else []:
            if path.stat().st_size >= at_least:
                return path
        if child.poll() is not None:
            pytest.fail(f"the pull ended (exit {child.returncode}) before it could be killed")
        time.sleep(0.02)
    child.kill()
    pytest.fail("the pull never wrote its partial file")
