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
from localllm.errors import InvalidInput, ModelFormatError
from localllm.models.create import create_model
from localllm.models.store import Store

pytestmark = pytest.mark.models

GREEDY = {"temperature": 0, "num_predict": 12, "num_ctx": 256, "num_parallel": 1, "spec_type": "none"}
PROMPT = "The capital of France is"


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


def write_lora(
    path: Path, *, n_embd: int = 576, layers: int = 6, rank: int = 4, arch: str = "llama", seed: int = 0, **overrides
) -> Path:
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
            writer.add_tensor(
                f"blk.{layer}.{name}.weight.lora_a", rng.normal(0, 0.2, (rank, n_embd)).astype(np.float32)
            )
            if not overrides.get("drop_b"):
                writer.add_tensor(
                    f"blk.{layer}.{name}.weight.lora_b", rng.normal(0, 0.2, (n_embd, rank)).astype(np.float32)
                )
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
    # `show --modelfile` names the model in FROM, so a model made from it keeps the adapter and its scale.
    _create_from_modelfile(store, "smol-lora-again", shown.modelfile, lora_path.parent)
    assert [a.scale for a in client.show("smol-lora-again").adapters] == [0.0]


@pytest.mark.parametrize("kind", ["text", "model", "unpaired"])
def test_a_file_that_is_not_a_gguf_lora_is_refused_and_never_stored(store, tmp_path, smollm2_path, kind):
    bad = tmp_path / "adapter.gguf"
    if kind == "text":
        bad.write_text("this is not a GGUF file at all\n")
    elif kind == "model":
        bad.symlink_to(smollm2_path)  # a GGUF, but a model, not an adapter
    else:
        write_lora(bad, drop_b=True)
    blobs = set(store.blobs.dir.iterdir())
    with pytest.raises(ModelFormatError) as caught:
        _create_from_modelfile(store, "smol-bad", "FROM smol\nADAPTER ./adapter.gguf\n", tmp_path)
    assert caught.value.status_code == 400
    assert {"text": "GGUF", "model": "not a LoRA adapter", "unpaired": "lacks its lora_a or lora_b"}[kind] in str(
        caught.value
    )
    assert set(store.blobs.dir.iterdir()) == blobs
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


# ---------------------------------------------------------------------------------------------------------- quantize


def write_f16(source: Path, out: Path) -> Path:
    """`source` (smollm2's Q4_1) dequantized with the gguf package: matrices F16, vectors F32, metadata kept."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for tensor in reader.tensors:
        data = dequantize(tensor.data, tensor.tensor_type).reshape([int(n) for n in reversed(tensor.shape)])
        writer.add_tensor(tensor.name, data.astype(np.float16 if data.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def f16_model(store, smollm2_path, tmp_path_factory) -> str:
    """`smol-f16` in the store: smollm2 with F16 weights, the kind of source quantizing is for."""
    path = write_f16(smollm2_path, tmp_path_factory.mktemp("f16") / "smol-f16.gguf")
    _drain(create_model(api.CreateRequest(model="smol-f16", **{"from": str(path)}), store))
    path.unlink()
    return "smol-f16"


@pytest.fixture
def quick_report(monkeypatch):
    # Two chunks of the built-in text and one thread: the figures stay meaningful, the test stays seconds long.
    monkeypatch.setenv("LOCALLLM_QUALITY_TOKENS", "512")
    monkeypatch.setenv("LOCALLLM_NUM_THREAD", "1")


@pytest.mark.slow
def test_quantize_to_q8_0_reports_a_near_lossless_copy_that_answers(store, client, f16_model, quick_report):
    statuses = [
        p.status
        for p in create_model(api.CreateRequest(model="smol-q8", quantize="q8_0", **{"from": f16_model}), store)
    ]
    assert "quantizing to Q8_0" in statuses and statuses[-1] == "success"
    assert any(s.startswith("quality of Q8_0 against smol-f16") for s in statuses)
    shown = client.show("smol-q8")
    report = shown.quantization_report
    assert shown.details.quantization_level == "Q8_0" and shown.details.parent_model == "smol-f16:latest"
    assert report.quantize == "Q8_0" and report.tokens >= 500
    assert report.top1_agreement >= 0.9
    assert 0 <= report.mean_kl < 0.05
    assert 0.9 < report.perplexity_quantized / report.perplexity_source < 1.1
    assert 0.45 < report.size_ratio < 0.6
    assert report.size_quantized == store.resolve("smol-q8").weights.stat().st_size
    assert report.decode_tps_source > 0 and report.decode_tps_quantized > 0
    assert _answer(client, "smol-q8").strip()


@pytest.mark.slow
def test_quantize_to_q4_k_m_from_the_cli_prints_the_report(store, client, f16_model, quick_report, monkeypatch):
    from typer.testing import CliRunner

    from localllm.cli import app

    monkeypatch.setenv("LOCALLLM_HOME", str(store.root.parent))
    result = CliRunner().invoke(app, ["create", "smol-q4", "--from", f16_model, "-q", "Q4_K_M"])
    assert result.exit_code == 0, result.output
    assert "quality of Q4_K_M against smol-f16" in result.output and "top-1 agreement" in result.output
    report = client.show("smol-q4").quantization_report
    assert report.quantize == "Q4_K_M" and 0.6 <= report.top1_agreement <= 1.0
    assert 0 <= report.mean_kl < 0.5 and report.size_ratio < 0.45
    assert client.show("smol-q4").details.quantization_level == "Q4_K_M"
    shown = CliRunner().invoke(app, ["show", "smol-q4"])
    assert "Quantization" in shown.output and "perplexity" in shown.output
    assert _answer(client, "smol-q4").strip()


def test_requantizing_needs_the_flag(store, client, monkeypatch):
    blobs = set(store.blobs.dir.iterdir())
    with pytest.raises(InvalidInput) as caught:
        _drain(create_model(api.CreateRequest(model="smol-rq", quantize="q8_0", **{"from": "smol"}), store))
    assert "already quantized (Q4_1" in caught.value.message and "--allow-requantize" in caught.value.hint
    assert set(store.blobs.dir.iterdir()) == blobs and not store.exists("smol-rq")
    monkeypatch.setenv("LOCALLLM_QUALITY_TOKENS", "0")  # no report: the flag is what is tested here
    _drain(
        create_model(
            api.CreateRequest(model="smol-rq", quantize="q8_0", allow_requantize=True, **{"from": "smol"}), store
        )
    )
    shown = client.show("smol-rq")
    assert shown.details.quantization_level == "Q8_0" and shown.quantization_report is None


@pytest.mark.parametrize(
    "qtype,message", [("q3_z", "quantize type 'q3_z' is not known"), ("iq2_xxs", "needs an importance matrix")]
)
def test_bad_quantize_requests_fail_before_any_work(store, f16_model, qtype, message):
    with pytest.raises(InvalidInput, match=message):
        _drain(create_model(api.CreateRequest(model="smol-bad-q", quantize=qtype, **{"from": f16_model}), store))
    assert not store.exists("smol-bad-q")


def write_imatrix(path: Path, store: Store, model: str) -> Path:
    """An importance matrix as llama-imatrix writes it: `<tensor>.in_sum2` and `.counts` for each matrix."""
    import gguf

    from localllm.quant.gguf import inspect_gguf

    writer = gguf.GGUFWriter(str(path), "")
    writer.add_string("general.type", "imatrix")
    tensors = inspect_gguf(store.resolve(model).weights).tensor_sizes
    rng = np.random.default_rng(1)
    for name in tensors:
        if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name:
            n_in = {"ffn_down": 1536}.get(name.split(".")[2], 576)
            writer.add_tensor(f"{name}.in_sum2", rng.uniform(1, 20, n_in).astype(np.float32))
            writer.add_tensor(f"{name}.counts", np.array([10.0], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_an_imatrix_makes_the_low_bit_types_possible(store, f16_model, tmp_path, monkeypatch):
    from localllm.quant.quantize import read_imatrix, run_quantize

    imatrix = write_imatrix(tmp_path / "smol.imatrix.gguf", store, f16_model)
    assert all(values.dtype == np.float32 and values.min() >= 0.1 for values in read_imatrix(imatrix).values())
    out = tmp_path / "q2.gguf"
    _drain(
        run_quantize(
            store.resolve(f16_model).weights,
            out,
            "q2_K_S",
            label=f16_model,
            imatrix=imatrix,
            threads=1,
            report_tokens=0,
        )
    )
    from localllm.quant.gguf import inspect_gguf

    assert "Q2_K" in inspect_gguf(out).tensor_types
    (tmp_path / "not.gguf").write_text("nope")
    with pytest.raises(InvalidInput, match="not a GGUF importance matrix"):
        read_imatrix(tmp_path / "not.gguf")


# ------------------------------------------------------------------------------------------------ shared weights


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_two_models_over_one_blob_share_the_weights_in_memory(store):
    from localllm.client.local import LocalClient

    _drain(create_model(api.CreateRequest(model="smol-brief", system="Answer briefly.", **{"from": "smol"}), store))
    weights = store.resolve("smol").weights.stat().st_size
    small = {"num_batch": 32}  # a small compute buffer, so that what a context costs is clearly below the weights
    client = LocalClient(store)
    try:
        plain = _answer(client, "smol", **small)
        before = _rss()
        assert _answer(client, "smol-brief", **small) == plain  # raw prompt: the SYSTEM does not apply
        shared = _rss() - before
        rows = {row.name: row for row in client.ps().models}
        assert rows["smol-brief:latest"].shares_weights_with == ["smol:latest"]
        assert rows["smol:latest"].shares_weights_with == ["smol-brief:latest"]
        before = _rss()
        _answer(client, "smol-brief", use_mmap=False, **small)  # weights read into memory: a copy of its own
        separate = _rss() - before
        assert shared < weights / 3 < separate, (shared, separate, weights)
        client.stop("smol")  # the other model keeps the weights alive
        assert _answer(client, "smol-brief", **small) == plain
    finally:
        client.close()


def test_plan_counts_shared_weights_once(store, monkeypatch):
    from typer.testing import CliRunner

    from localllm.cli import app

    _drain(create_model(api.CreateRequest(model="smol-terse", system="Be terse.", **{"from": "smol"}), store))
    monkeypatch.setenv("LOCALLLM_HOME", str(store.root.parent))
    one = json.loads(CliRunner().invoke(app, ["plan", "smol", "--json"]).output)
    both = CliRunner().invoke(app, ["plan", "smol", "smol-terse", "--json"])
    assert both.exit_code == 0, both.output
    assert json.loads(both.output)["total"] == 2 * one["total"] - one["weights"]
    text = CliRunner().invoke(app, ["plan", "smol", "smol-terse"]).output
    assert "shared with a model above: counted once" in text


# ------------------------------------------------------------------------------------------------ split GGUFs


def write_split(source: Path, out: Path, parts: int = 3) -> list[Path]:
    """`source` cut into `parts` files as gguf-split cuts them (the gguf package's shards: split.no, split.count and
    split.tensors.count in each part, the metadata in the first), tensors copied as they are."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    per_part = -(-len(reader.tensors) // parts)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents(), split_max_tensors=per_part)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return [out.with_name(f"{out.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]


@pytest.fixture(scope="module")
def split_files(smollm2_path, tmp_path_factory) -> list[Path]:
    return write_split(smollm2_path, tmp_path_factory.mktemp("split") / "smol-Q4_1.gguf")


@pytest.fixture
def hub_url(split_files, monkeypatch):
    from hfserver import Hub, HubServer

    files = {path.name: path.read_bytes() for path in split_files}
    hub = Hub(repos={"test-org/smol-split-GGUF": {"README.md": b"# split", **files}}, files=files)
    with HubServer(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
        yield url, hub


@pytest.mark.slow
def test_a_split_gguf_pulls_from_the_hub_and_answers_like_the_whole_file(store, client, split_files, hub_url):
    from localllm.models.pull import pull_model

    _drain(pull_model("hf.co/test-org/smol-split-GGUF:Q4_1", store))
    model = store.resolve("hf.co/test-org/smol-split-GGUF:Q4_1")
    assert [p.name for p in model.parts] == [f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert [p.resolve().read_bytes() for p in model.parts] == [f.read_bytes() for f in split_files]
    shown = client.show("hf.co/test-org/smol-split-GGUF:Q4_1")
    whole = client.show("smol")
    assert len(shown.parts) == 3 and shown.details.parameter_size == whole.details.parameter_size
    assert shown.model_info["general.parameter_count"] == whole.model_info["general.parameter_count"]
    assert _answer(client, "hf.co/test-org/smol-split-GGUF:Q4_1") == _answer(client, "smol")


def test_a_url_to_one_part_pulls_every_part(store, split_files, hub_url, monkeypatch):
    from typer.testing import CliRunner

    from localllm.cli import app
    from localllm.models.pull import pull_model

    url, _ = hub_url
    _drain(pull_model(f"{url}/files/{split_files[1].name}", store))
    model = store.resolve("smol-q4_1:latest")
    assert len(model.parts) == 3 and model.size == sum(f.stat().st_size for f in split_files)
    monkeypatch.setenv("LOCALLLM_HOME", str(store.root.parent))
    split = json.loads(CliRunner().invoke(app, ["plan", "smol-q4_1", "--json"]).output)
    whole = json.loads(CliRunner().invoke(app, ["plan", "smol", "--json"]).output)
    assert split["weights"] == whole["weights"] and split["kv_total"] == whole["kv_total"]


def test_a_split_with_a_missing_part_is_refused(store, split_files, monkeypatch):
    from hfserver import Hub, HubServer

    from localllm.errors import ModelNotFound
    from localllm.models.pull import pull_model

    files = {path.name: path.read_bytes() for path in split_files[:2]}
    with HubServer(Hub(repos={"test-org/broken-GGUF": files})) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
        with pytest.raises(ModelNotFound, match="lacks smol-Q4_1-00003-of-00003.gguf"):
            _drain(pull_model("hf.co/test-org/broken-GGUF:Q4_1", store))
    assert not store.exists("hf.co/test-org/broken-GGUF:Q4_1")


# ---------------------------------------------------------------------------------------------------------- REST


@pytest.mark.slow
def test_api_create_quantizes_in_the_background_and_refuses_bad_adapters(store, f16_model, quick_report, tmp_path):
    import httpx
    from server_harness import serve_in_thread

    from localllm.client.local import LocalClient
    from localllm.server.app import create_app

    client = LocalClient(store)
    try:
        with serve_in_thread(create_app(client)) as url, httpx.Client(base_url=url, timeout=120) as http:
            body = {"model": "smol-q4-rest", "from": f16_model, "quantize": "q4_0"}
            with http.stream("POST", "/api/create", json=body) as stream:
                lines = stream.iter_lines()
                statuses = [json.loads(next(lines))["status"]]
                while not statuses[-1].startswith("quantizing"):
                    statuses.append(json.loads(next(lines))["status"])
                # The quantizer works in its own process: the server still answers meanwhile.
                assert http.get("/api/tags").status_code == 200
                answer = http.post(
                    "/api/generate",
                    json={"model": "smol", "prompt": PROMPT, "raw": True, "stream": False, "options": GREEDY},
                )
                assert answer.status_code == 200 and answer.json()["response"]
                statuses += [json.loads(line)["status"] for line in lines]
            assert statuses[-1] == "success" and any(s.startswith("quality of Q4_0") for s in statuses)
            shown = http.post("/api/show", json={"model": "smol-q4-rest"}).json()
            assert shown["details"]["quantization_level"] == "Q4_0"
            assert shown["quantization_report"]["top1_agreement"] > 0.5
            (tmp_path / "notes.txt").write_text("not an adapter")
            refused = http.post(
                "/api/create",
                json={"model": "smol-bad-rest", "from": "smol", "adapters": {str(tmp_path / "notes.txt"): ""}},
            )
            assert refused.status_code == 400 and "not a usable GGUF" in refused.json()["error"]
            requant = http.post("/api/create", json={"model": "smol-rq-rest", "from": "smol", "quantize": "q8_0"})
            assert requant.status_code == 400 and "allow-requantize" in requant.json()["error"]
    finally:
        client.close()


def test_a_split_part_with_other_bytes_than_announced_is_refused(tmp_path, split_files, monkeypatch):
    from hfserver import Hub, HubServer

    store = Store(tmp_path / "models")  # empty: the module's store already holds these parts, so would not fetch them

    from localllm.errors import IntegrityError
    from localllm.models.pull import pull_model

    files = {path.name: path.read_bytes() for path in split_files}
    with HubServer(Hub(repos={"test-org/corrupt-GGUF": files}, corrupt=True)) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
        with pytest.raises(IntegrityError, match="sha256 mismatch"):
            _drain(pull_model("hf.co/test-org/corrupt-GGUF:Q4_1", store))
    assert not store.exists("hf.co/test-org/corrupt-GGUF:Q4_1")
