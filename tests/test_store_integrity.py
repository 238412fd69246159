"""Store integrity under races and faults, with real processes, real files and a loopback HTTP server: rm racing cp,
resumed pulls of a file that changed upstream, a full disk (a small tmpfs), replaced names and prune, duplicate
downloads, repair of corrupt blobs, and a server that notices a model removed from the command line."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hfserver import Hub, HubServer, sha256_of, write_tiny_gguf
from typer.testing import CliRunner

from localllm.cli import app
from localllm.errors import ModelNotFound, NetworkError
from localllm.models.pull import DOWNLOAD_ATTEMPTS, pull_model
from localllm.models.store import Store

runner = CliRunner()
ROUNDS = 200


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def localllm(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    """The real CLI in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "localllm", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, LOCALLLM_HOME=str(home), **env),
    )


@pytest.fixture
def store(isolated_home) -> Store:
    return Store(isolated_home / "models")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, bytes]:
    """Two versions of one file, the same length (a changed upload), and a small unrelated one."""
    folder = tmp_path_factory.mktemp("ggufs")
    return {
        "v1": write_tiny_gguf(folder / "v1.gguf", name="version 1", pad_floats=65536).read_bytes(),
        "v2": write_tiny_gguf(folder / "v2.gguf", name="version 2", pad_floats=65536).read_bytes(),
        "small": write_tiny_gguf(folder / "small.gguf", name="small").read_bytes(),
        "big": write_tiny_gguf(folder / "big.gguf", name="big", pad_floats=400_000).read_bytes(),
    }


@pytest.fixture
def hub(ggufs) -> Hub:
    return Hub(files={"model.gguf": ggufs["v1"]})


@pytest.fixture
def server(hub, monkeypatch) -> str:
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    with HubServer(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield url


# ------------------------------------------------------------------------------------------------------- rm vs cp


def _race_worker(root: str, action: str, barrier, rounds: int) -> None:
    store = Store(Path(root))
    for _ in range(rounds):
        barrier.wait(timeout=60)
        try:
            store.delete("a") if action == "rm" else store.copy("a", "b")
        except ModelNotFound:
            pass  # the other side won this round
        barrier.wait(timeout=60)


def test_rm_racing_cp_never_leaves_a_dangling_manifest(store, tmp_path):
    data = write_tiny_gguf(tmp_path / "a.gguf").read_bytes()
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(3)
    workers = [
        context.Process(target=_race_worker, args=(str(store.root), action, barrier, ROUNDS)) for action in ("rm", "cp")
    ]
    for worker in workers:
        worker.start()
    try:
        for _ in range(ROUNDS):
            store.write_model("a", weights=store.blobs.add_bytes(data))
            barrier.wait(timeout=60)  # both processes go
            barrier.wait(timeout=60)  # both are done
            assert store.verify() == []
            if store.exists("b"):
                store.delete("b")
            if store.exists("a"):
                store.delete("a")
            assert not any(store.blobs.dir.iterdir())  # nothing named, nothing kept
    finally:
        for worker in workers:
            worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    result = invoke("verify")
    assert result.exit_code == 0 and "all blobs intact" in result.output


# ------------------------------------------------------------------------------------------------------- resume


def _fail_halfway(hub: Hub, url: str, store: Store) -> NetworkError:
    """A pull that keeps losing its connection: it gives up with bytes of the first version in its partial file."""
    hub.drop_after, hub.drops_left = 30_000, DOWNLOAD_ATTEMPTS
    with pytest.raises(NetworkError) as failure:
        list(pull_model(url, store))
    hub.drops_left = 0
    return failure.value


@pytest.mark.parametrize("if_range", [True, False], ids=["if-range", "server-ignores-if-range"])
def test_a_resumed_pull_of_a_file_changed_upstream_stores_the_new_file(server, hub, store, ggufs, if_range):
    hub.if_range = if_range
    url = f"{server}/files/model.gguf"
    error = _fail_halfway(hub, url, store)
    (partial,) = store.blobs.partials()
    assert 0 < partial.stat().st_size < len(ggufs["v1"]) and str(partial) in str(error)  # kept, and said where
    hub.files["model.gguf"] = ggufs["v2"]  # replaced upstream between the two pulls
    list(pull_model(url, store))
    assert store.resolve("model").weights.read_bytes() == ggufs["v2"]
    assert store.verify() == [] and store.blobs.partials() == []
    assert hub.ranges()[DOWNLOAD_ATTEMPTS] == f"bytes={hub.drop_after * DOWNLOAD_ATTEMPTS}-"  # it tried to resume


def test_a_url_without_validators_is_never_resumed(server, hub, store, ggufs):
    hub.validators = False
    url = f"{server}/files/model.gguf"
    _fail_halfway(hub, url, store)
    assert store.blobs.partials() == []  # nothing could prove those bytes later: not kept
    assert hub.ranges() == [None] * DOWNLOAD_ATTEMPTS  # each attempt started over
    hub.files["model.gguf"] = ggufs["v2"]
    list(pull_model(url, store))
    assert store.resolve("model").weights.read_bytes() == ggufs["v2"] and store.verify() == []


# ------------------------------------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 1 MB tmpfs as LOCALLLM_HOME (needs root and mount rights, e.g. CI in its container)."""
    home = tmp_path / "tmpfs-home"
    home.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and the mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(home)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.strip()}")
    try:
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


@pytest.mark.parametrize("send_length", [True, False], ids=["size-known", "size-unknown"])
def test_a_pull_onto_a_full_disk_is_one_line_and_leaves_the_disk_usable(server, hub, ggufs, small_disk, send_length):
    hub.send_length = send_length  # known: refused before writing; unknown: ENOSPC half-way
    hub.files.update({"model.gguf": ggufs["big"], "small.gguf": ggufs["small"]})
    free_before = shutil.disk_usage(small_disk).free
    result = localllm("pull", f"{server}/files/model.gguf", home=small_disk)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "not enough disk space" in line and "model.gguf" in line and str(small_disk) in line
    assert shutil.disk_usage(small_disk).free >= free_before - 64 * 1024  # no partial left filling it
    assert localllm("pull", f"{server}/files/small.gguf", home=small_disk).returncode == 0  # the store still works
    assert localllm("cp", "small", "small-copy", home=small_disk).returncode == 0
    assert localllm("verify", home=small_disk).returncode == 0


def test_the_api_answers_507_when_the_disk_is_full(server, hub, ggufs, small_disk):
    from server_harness import serve_in_thread

    from localllm.client.local import LocalClient
    from localllm.server.app import create_app

    hub.files["model.gguf"] = ggufs["big"]
    client = LocalClient(store=Store(small_disk / "models"))
    try:
        with serve_in_thread(create_app(client)) as base:
            answer = httpx.post(
                f"{base}/api/pull", json={"model": f"{server}/files/model.gguf", "stream": False}, timeout=60
            )
    finally:
        client.close()
    assert answer.status_code == 507 and "not enough disk space" in answer.json()["error"]
    assert Store(small_disk / "models").blobs.partials() == []


# ------------------------------------------------------------------------------------------------------- overwrite


def test_cp_over_a_name_collects_the_old_blob_and_prune_frees_leftovers(store, tmp_path):
    old = store.blobs.add_file(write_tiny_gguf(tmp_path / "old.gguf", name="old", pad_floats=4096))
    store.write_model("target", weights=old)
    new = store.blobs.add_file(write_tiny_gguf(tmp_path / "new.gguf", name="new"))
    store.write_model("source", weights=new)
    result = invoke("cp", "source", "target")
    assert result.exit_code == 0 and "replaced the previous 'target:latest'" in result.output
    assert "freed" in result.output and not store.blobs.has(old)
    assert store.resolve("target").weights == store.blobs.path(new)
    # What a crash leaves behind: a blob nobody names, a partial download, a temp file.
    (store.blobs.dir / old).write_bytes(b"o" * 5000)
    (store.blobs.dir / f"{old}-partial").write_bytes(b"p" * 3000)
    (store.blobs.dir / ".tmp-0123").write_bytes(b"t" * 2000)
    dry = invoke("prune", "--dry-run")
    assert dry.exit_code == 0 and "would free 10 KB" in dry.output and store.blobs.has(old)
    pruned = invoke("prune")
    assert pruned.exit_code == 0 and pruned.output.strip().splitlines()[-1] == "freed 10 KB"
    assert {p.name for p in store.blobs.dir.iterdir()} == _layer_digests(store)
    assert store.verify() == [] and invoke("prune").output.strip() == "freed 0 B"


def _layer_digests(store: Store) -> set[str]:
    import json

    return {
        layer["digest"]
        for path in store.manifests_dir.rglob("*")
        if path.is_file()
        for layer in json.loads(path.read_text())["layers"]
    }


# ------------------------------------------------------------------------------------------------------- duplicates


def _holds_open(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="watches the waiting pull through /proc")
@pytest.mark.parametrize("kind", ["url", "hf"])
def test_two_pulls_of_one_file_at_once_make_one_download(server, hub, store, ggufs, isolated_home, kind):
    hub.repos["org/one-GGUF"] = {"one.Q8_0.gguf": ggufs["v1"]}
    hub.gate, hub.gate_after = threading.Event(), 64 * 1024
    name, file = (
        (f"{server}/files/model.gguf", "model.gguf") if kind == "url" else ("hf.co/org/one-GGUF:Q8_0", "one.Q8_0.gguf")
    )
    env = dict(os.environ, LOCALLLM_HOME=str(isolated_home), HF_ENDPOINT=server)
    command = [sys.executable, "-m", "localllm", "pull", name]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        partial = _wait_for(lambda: next(iter(store.blobs.partials()), None), first)  # the first is downloading
        lock = store.blobs.locks_dir / partial.name.replace("-partial", ".lock")
        second = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for(lambda: _holds_open(second.pid, lock), second)  # the second waits on the blob's lock
    finally:
        hub.gate.set()
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outputs
    assert hub.downloads_of(file) == 1
    assert store.resolve(name if kind == "hf" else "model").weights.read_bytes() == ggufs["v1"]
    assert store.verify() == [] and store.blobs.partials() == []


def _wait_for(probe, process: subprocess.Popen):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        if process.poll() is not None:
            pytest.fail(f"the pull ended early: {process.communicate()}")
        time.sleep(0.02)
    pytest.fail("timed out waiting for the pull")


# ------------------------------------------------------------------------------------------------------- repair


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_pull_after_verify_replaces_a_corrupt_shared_blob(server, hub, store, ggufs):
    hub.repos["org/one-GGUF"] = {"one.Q8_0.gguf": ggufs["v1"]}
    list(pull_model("hf.co/org/one-GGUF:Q8_0", store))
    invoke("cp", "hf.co/org/one-GGUF:Q8_0", "mine")  # two names share the blob
    blob = store.resolve("mine").weights
    _corrupt(blob)
    assert invoke("verify").exit_code == 1  # and marks the blob corrupt
    downloads = hub.downloads_of("one.Q8_0.gguf")
    result = invoke("pull", "hf.co/org/one-GGUF:Q8_0")
    assert result.exit_code == 0 and hub.downloads_of("one.Q8_0.gguf") == downloads + 1
    assert blob.read_bytes() == ggufs["v1"] and invoke("verify").exit_code == 0  # both names whole again


def test_verify_repair_downloads_corrupt_blobs_again_in_place(server, hub, store, ggufs, tmp_path):
    hub.repos["org/one-GGUF"] = {"one.Q8_0.gguf": ggufs["v1"]}
    list(pull_model("hf.co/org/one-GGUF:Q8_0", store))
    invoke("cp", "hf.co/org/one-GGUF:Q8_0", "mine")
    list(pull_model(str(write_tiny_gguf(tmp_path / "local.gguf", name="local")), store))
    weights, local = store.resolve("mine").weights, store.resolve("local").weights
    _corrupt(weights)
    _corrupt(local)
    result = invoke("verify", "--repair")
    assert result.exit_code == 1 and "cannot repair" in result.output  # the local file has no source to fetch from
    assert weights.read_bytes() == ggufs["v1"]
    assert store.verify() == [
        f"local:latest: blob {local.name} is corrupt (its bytes hash to sha256-{sha256_of(local.read_bytes())})"
    ]
    invoke("rm", "local")
    repaired = invoke("verify", "--repair")
    assert repaired.exit_code == 0 and "all blobs intact" in repaired.output


# ------------------------------------------------------------------------------------------------------- server


@pytest.mark.models
def test_the_server_notices_a_model_removed_from_the_command_line(models_home, tmp_path):
    from server_harness import private_home, serve_in_thread

    from localllm.client.local import LocalClient
    from localllm.models.options import resolve_options
    from localllm.server.app import create_app

    home = private_home(models_home, tmp_path / "home")
    client = LocalClient(store=Store(home / "models"))
    model = client.store.resolve("smollm2:135m")
    try:
        with serve_in_thread(create_app(client)) as base:
            load, _ = resolve_options(model, {})
            with client.pool.acquire(model, load, keep_alive=600):  # a request still running on it
                assert localllm("rm", "smollm2:135m", home=home).returncode == 0
                (row,) = httpx.get(f"{base}/api/ps").json()["models"]
                assert row["name"] == "smollm2:135m" and row["status"] == "removed"
                answer = httpx.post(f"{base}/api/generate", json={"model": "smollm2:135m", "prompt": "hi"})
                assert answer.status_code == 404
            assert httpx.get(f"{base}/api/ps").json()["models"] == []  # unloaded once its request ended
    finally:
        client.close()


def test_prune_waits_for_a_pull_in_progress_and_takes_nothing_from_it(server, hub, store, ggufs, isolated_home):
    hub.repos["org/one-GGUF"] = {"one.Q8_0.gguf": ggufs["v1"]}
    hub.gate, hub.gate_after = threading.Event(), 64 * 1024
    env = dict(os.environ, LOCALLLM_HOME=str(isolated_home), HF_ENDPOINT=server)
    pull = subprocess.Popen(
        [sys.executable, "-m", "localllm", "pull", "hf.co/org/one-GGUF:Q8_0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    waited, reports = threading.Event(), []
    try:
        _wait_for(lambda: store.blobs.partials(), pull)  # the pull is writing its partial file
        pruner = threading.Thread(target=lambda: reports.append(store.prune(on_wait=waited.set)))
        pruner.start()
        assert waited.wait(timeout=120) and not reports  # it waits; it has removed nothing
    finally:
        hub.gate.set()
    pruner.join(timeout=120)
    assert pull.wait(timeout=120) == 0
    assert reports[0].removed == [] and store.verify() == []
