"""LoRA adapters whose tensors do not fit the base (issue 34): `create` checks every adapter tensor's name, rank and
shape against the base model and refuses the misfits with 400, and the first load of a (base, adapter) pair runs in
the load probe's child, so an adapter that still aborts llama.cpp fails only its request. Adapters are written here
with the `gguf` package; after each, the server answers a plain request."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
from server_harness import SMALL, private_home, served

from localllm import api
from localllm.backends.llama_cpp.probe import LoadProbe, pair_key
from localllm.errors import InvalidInput, ModelFormatError
from localllm.models.create import create_model
from localllm.models.store import Store

pytestmark = pytest.mark.models

N_EMBD, N_KV = 576, 192  # smollm2:135m: attn_q is [576, 576] in ggml order, attn_k [576, 192]
Pair = tuple[str, Sequence[int], Sequence[int]]  # base tensor, lora_a and lora_b shapes (numpy order)
NO_TRIAL = api.LoadOptions(flash_attn=False)  # the probe's flash attention trial has nothing to do with adapters


def write_adapter(path: Path, pairs: Sequence[Pair], *, seed: int = 0) -> Path:
    """A GGUF LoRA as convert_lora_to_gguf.py writes one, with exactly these tensor shapes (numpy order: the reverse
    of ggml's, so a lora_a for an [n_in, n_out] weight is (rank, n_in))."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 4.0)
    for name, a, b in pairs:
        writer.add_tensor(f"{name}.lora_a", rng.normal(0, 0.02, tuple(a)).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", rng.normal(0, 0.02, tuple(b)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


Q, K = "blk.0.attn_q.weight", "blk.0.attn_k.weight"
GOOD: list[Pair] = [(Q, (4, N_EMBD), (N_EMBD, 4)), (K, (4, N_EMBD), (N_KV, 4))]
BAD: dict[str, tuple[list[Pair], str]] = {
    "3-D lora_a": ([(Q, (2, 4, N_EMBD), (N_EMBD, 4))], "dimensions past the second"),
    "wrong input dim": ([(Q, (4, 512), (N_EMBD, 4))], "do not fit the base tensor [576, 576]"),
    "wrong output dim": ([(K, (4, N_EMBD), (N_EMBD, 4))], "do not fit the base tensor [576, 192]"),
    "rank mismatch": ([(Q, (4, N_EMBD), (N_EMBD, 8))], "ranks (4, 8) differ"),
    "a and b swapped": ([(K, (N_KV, 4), (4, N_EMBD))], "do not fit the base tensor"),
    "not in the base": ([("blk.99.attn_q.weight", (4, N_EMBD), (N_EMBD, 4))], "'blk.99.attn_q.weight' is not in"),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2_path) -> Store:
    home = tmp_path_factory.mktemp("adapters")
    (home / "smollm2.gguf").symlink_to(smollm2_path)
    store = Store(home / "models")
    for _ in create_model(api.CreateRequest(model="smol", **{"from": str(home / "smollm2.gguf")}), store):
        pass
    return store


def create_with(store: Store, name: str, adapter: Path) -> None:
    request = api.CreateRequest(model=name, modelfile=f"FROM smol\nADAPTER {adapter}\n")
    for _ in create_model(request, store):
        pass


@pytest.mark.parametrize("pairs, named", BAD.values(), ids=BAD.keys())
def test_create_refuses_an_adapter_that_does_not_fit_the_base(store, tmp_path, pairs, named):
    adapter = write_adapter(tmp_path / "bad.gguf", pairs)
    blobs = set((store.root / "blobs").iterdir())
    with pytest.raises(ModelFormatError) as refused:
        create_with(store, "smol-bad", adapter)
    assert refused.value.status_code == 400 and named in str(refused.value), refused.value
    assert "does not fit smol" in str(refused.value)
    assert set((store.root / "blobs").iterdir()) == blobs and not store.exists("smol-bad")


def test_create_takes_an_adapter_that_fits(store, tmp_path):
    create_with(store, "smol-good", write_adapter(tmp_path / "good.gguf", GOOD))
    assert len(store.resolve("smol-good").adapters) == 1


def test_a_3d_lora_a_really_aborts_llama_cpp_and_the_pair_probe_survives_it(tmp_path, smollm2_path):
    """The refusal above is no guess: llama.cpp's own checks pass this adapter, and the first multiplication
    aborts the process (here, the probe's child)."""
    adapter = write_adapter(tmp_path / "3d.gguf", BAD["3-D lora_a"][0])
    probe = LoadProbe(tmp_path / "probes")
    with pytest.raises(ModelFormatError, match="with its LoRA adapters crashed llama.cpp while loading: .*"):
        probe.check(smollm2_path, NO_TRIAL, adapters=[api.LoraAdapter(path=str(adapter))])
    assert not (tmp_path / "probes" / pair_key(smollm2_path, [adapter])).exists()
    good = write_adapter(tmp_path / "good.gguf", GOOD)
    probe.check(smollm2_path, NO_TRIAL, adapters=[api.LoraAdapter(path=str(good))])
    assert (tmp_path / "probes" / pair_key(smollm2_path, [good])).is_file()  # a pair that loads is remembered


# ---------------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(models_home, tmp_path_factory):
    home = private_home(models_home, tmp_path_factory.mktemp("adapter-server"))
    with served(home, LOCALLLM_HOME=str(home)) as url:
        yield url


def answers_a_plain_request(url: str, model: str = "smollm2:135m") -> None:
    reply = httpx.post(
        f"{url}/api/generate", json={"model": model, "prompt": "Hi", "stream": False, "options": SMALL}, timeout=120
    )
    assert reply.status_code == 200 and reply.json()["done"], reply.text


@pytest.mark.parametrize("case", list(BAD))
def test_server_refuses_each_misfit_at_create_and_still_answers(server, tmp_path, case):
    adapter = write_adapter(tmp_path / "bad.gguf", BAD[case][0])
    body = {"model": "lora:bad", "modelfile": f"FROM smollm2:135m\nADAPTER {adapter}\n", "stream": False}
    reply = httpx.post(f"{server}/api/create", json=body, timeout=60)
    assert reply.status_code == 400 and BAD[case][1] in reply.json()["error"], reply.text
    answers_a_plain_request(server)


def test_server_answers_with_an_adapter_that_fits(server, tmp_path):
    adapter = write_adapter(tmp_path / "good.gguf", GOOD)
    body = {"model": "lora:good", "modelfile": f"FROM smollm2:135m\nADAPTER {adapter}\n", "stream": False}
    assert httpx.post(f"{server}/api/create", json=body, timeout=60).status_code == 200
    answers_a_plain_request(server, "lora:good")
    answers_a_plain_request(server)


# ---------------------------------------------------------------------------------------------------------- fuzz

DIMS = (1, 2, 4, N_KV, 512, N_EMBD, 1536)


NAMES = (Q, K, "blk.0.ffn_up.weight", "token_embd.weight", "blk.0.attn_norm.weight", "blk.40.x")


def fuzz_pair(rng: random.Random, name: str) -> Pair:
    rank = rng.choice((1, 4, 8))
    a = [rank, rng.choice((N_EMBD, N_EMBD, 512))]
    b = [rng.choice((N_EMBD, N_KV, 1536, rank)), rng.choice((rank, rank, 2))]
    if rng.random() < 0.2:
        a = [rng.choice((1, 2)), *a]
    if rng.random() < 0.1:
        a, b = b, a
    if rng.random() < 0.2:
        b = [rng.choice(DIMS)]
    return name, a, b


def test_fuzzed_adapter_shapes_are_created_only_when_they_load(store, tmp_path):
    """Sixty adapters of random shapes through create: each is refused cleanly, or is created and then loads with
    the base in the probe's child (a crash there would be a shape create let through)."""
    rng = random.Random(34)
    created, refused = [], 0
    for case in range(60):
        adapter = write_adapter(
            tmp_path / f"fuzz-{case}.gguf", [fuzz_pair(rng, n) for n in rng.sample(NAMES, rng.randint(1, 2))]
        )
        try:
            create_with(store, f"smol-fuzz-{case}", adapter)
            created.append(case)
        except (ModelFormatError, InvalidInput) as exc:
            assert exc.status_code == 400 and "\n" not in str(exc)
            refused += 1
    assert refused > 30 and created, (refused, created)
    probe = LoadProbe(tmp_path / "probes")
    for case in created[:2]:  # each probe is a child process: a few suffice
        model = store.resolve(f"smol-fuzz-{case}")
        probe.check(model.weights, NO_TRIAL, adapters=list(model.adapters))
