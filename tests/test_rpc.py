"""Scale-out over llama.cpp's RPC backend: a real `localllm worker` process on loopback, a real server process whose
LOCALLLM_RPC points at it, smollm2:135m split between the two. The server is a process of its own because a lost
worker is handled in native code (ggml's abort path) that a test process should not share."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_harness import free_port, private_home
from typer.testing import CliRunner

from localllm.cli import app

pytestmark = [pytest.mark.models, pytest.mark.slow]

PROMPT = "List the planets of the solar system, one per line."
GREEDY = {"temperature": 0, "num_predict": 24, "num_ctx": 512, "num_parallel": 1, "spec_type": "none"}


def _child_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALLLM_")}
    env.update(LOCALLLM_HOME=str(home), LOCALLLM_NUM_THREAD="1", **extra)
    return env


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def started(args: list[str], env: dict[str, str], port: int, log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "localllm", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_for_port(port, proc, log)
        yield proc
    finally:
        _stop(proc)


@pytest.fixture
def home(models_home, tmp_path) -> Path:
    return private_home(models_home, tmp_path / "home")


def _generate(url: str, **options) -> str:
    response = httpx.post(
        f"{url}/api/generate",
        timeout=180,
        json={"model": "smollm2:135m", "prompt": PROMPT, "stream": False, "options": {**GREEDY, **options}},
    )
    assert response.status_code == 200, response.text
    return response.json()["response"]


def test_a_worker_holds_layers_and_the_greedy_answer_is_the_local_one(home, tmp_path):
    worker_port, server_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{worker_port}"
    worker_log = tmp_path / "worker.log"
    env = _child_env(home, LOCALLLM_HOST=f"127.0.0.1:{server_port}", LOCALLLM_RPC=endpoint)
    with (
        started(["worker", "--port", str(worker_port), "--threads", "1"], env, worker_port, worker_log),
        started(["serve"], env, server_port, tmp_path / "server.log"),
    ):
        url = f"http://127.0.0.1:{server_port}"
        local = _generate(url, rpc="")  # the same model without the worker: a load of its own
        ps = httpx.get(f"{url}/api/ps").json()["models"][0]
        assert [p["device"] for p in ps["placement"]] == ["CPU"]

        # LOCALLLM_RPC applies; num_gpu splits the layers between this machine's CPU and the worker's.
        remote = _generate(url, num_gpu=20)
        ps = httpx.get(f"{url}/api/ps").json()["models"]
        assert len(ps) == 1  # the rpc option is part of the load identity: the local load was replaced
        placed = {p["device"]: p for p in ps[0]["placement"]}
        assert placed["RPC0"]["layers"] == 20 and placed["RPC0"]["description"] == endpoint
        assert placed["CPU"]["layers"] == 11  # 30 blocks + the output head, less the worker's 20
        assert ps[0]["gpu_layers"] == 20 and ps[0]["size_vram"] == placed["RPC0"]["memory"] > 0
        assert remote == local and len(local) > 10
        assert "Accepted client connection" in worker_log.read_text()  # llama.cpp's client connected there

        # The CLI surfaces the same: `ps` names the worker, `plan` shows the split it would make now.
        table = subprocess.run(
            [sys.executable, "-m", "localllm", "ps"],
            env={**env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"RPC0 {endpoint} 20" in table.stdout, table.stdout


def _running(url: str) -> dict:
    models = [m for m in httpx.get(f"{url}/api/ps").json()["models"] if m["name"] == "smollm2:135m"]
    assert len(models) == 1, models
    return models[0]


def _wait_until_unloaded(url: str, seconds: float = 90) -> None:
    """The pool checks for workers that are back every few seconds and unloads the model running without them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(m["name"] == "smollm2:135m" for m in httpx.get(f"{url}/api/ps").json()["models"]):
            return
        time.sleep(0.5)
    raise AssertionError(f"the model running without its worker was not unloaded within {seconds:.0f} s")


def test_a_worker_that_goes_away_mid_answer_ends_that_request_and_the_server_lives_on(home, tmp_path):
    worker_port, server_port = free_port(), free_port()
    env = _child_env(home, LOCALLLM_HOST=f"127.0.0.1:{server_port}", LOCALLLM_RPC=f"127.0.0.1:{worker_port}")
    server_log = tmp_path / "server.log"
    with started(["serve"], env, server_port, server_log) as server:
        url = f"http://127.0.0.1:{server_port}"
        with started(
            ["worker", "--port", str(worker_port), "--threads", "1"], env, worker_port, tmp_path / "worker.log"
        ) as worker:
            lines = []
            body = {
                "model": "smollm2:135m",
                "prompt": PROMPT,
                "stream": True,
                "options": {**GREEDY, "num_predict": 400, "ignore_eos": True},
            }
            with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=120) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    lines.append(json.loads(line))
                    if len(lines) == 3:
                        worker.kill()  # the worker dies mid-answer
            assert "error" not in lines[0]
            last = lines[-1]
            assert f"RPC worker at 127.0.0.1:{worker_port} went away" in last.get("error", ""), last
            assert not any(line.get("done") for line in lines[:-1])

        assert server.poll() is None  # the server lives on
        assert httpx.get(f"{url}/health").status_code == 200
        assert len(_generate(url, rpc="")) > 0  # and answers from this machine alone
        # While the server's worker is gone, a model that fits here runs here alone, and ps says what it lacks...
        assert len(_generate(url)) > 0
        assert _running(url)["missing_workers"] == [f"127.0.0.1:{worker_port}"]
        assert not any(p["device"].startswith("RPC") for p in _running(url)["placement"])
        # ...and once the worker is back, the model loads with it again (it used to need a restart of this server).
        with started(["worker", "--port", str(worker_port), "--threads", "1"], env, worker_port, tmp_path / "w2.log"):
            _wait_until_unloaded(url)
            assert len(_generate(url)) > 0
            ps = _running(url)
            assert any(p["device"].startswith("RPC") for p in ps["placement"]), ps["placement"]
            assert ps["missing_workers"] == []
        assert "Accepted client connection" in (tmp_path / "w2.log").read_text()


def test_a_worker_that_accepts_and_never_answers_is_a_fast_503(home, tmp_path):
    server_port = free_port()
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never reads or replies
    worker = f"127.0.0.1:{listener.getsockname()[1]}"
    env = _child_env(home, LOCALLLM_HOST=f"127.0.0.1:{server_port}")
    try:
        with started(["serve"], env, server_port, tmp_path / "server.log") as server:
            url = f"http://127.0.0.1:{server_port}"
            reply = httpx.post(
                f"{url}/api/generate",
                timeout=120,  # it hung past 150 s before
                json={"model": "smollm2:135m", "prompt": "Hi", "stream": False, "options": {**GREEDY, "rpc": worker}},
            )
            assert reply.status_code == 503, reply.text
            assert f"RPC worker at {worker} accepted a connection but did not answer" in reply.json()["error"]
            assert len(_generate(url, rpc="")) > 0 and server.poll() is None
    finally:
        listener.close()


def test_a_worker_that_stalls_mid_answer_fails_that_request_within_the_deadline(home, tmp_path):
    """A worker stopped (SIGSTOP) mid-answer: llama.cpp's client would wait on it for good; the guard's deadline
    ends that request with a 503-class error, the server answers from this machine, and once the same worker
    resumes (SIGCONT, no restart) it takes the model's layers again: the abandoned connection was shut, so the
    worker, which serves one client at a time, is free for the next load."""
    worker_port, server_port = free_port(), free_port()
    env = _child_env(
        home,
        LOCALLLM_HOST=f"127.0.0.1:{server_port}",
        LOCALLLM_RPC=f"127.0.0.1:{worker_port}",
        LOCALLLM_RPC_TIMEOUT="10",
    )
    with started(["serve"], env, server_port, tmp_path / "server.log") as server:
        url = f"http://127.0.0.1:{server_port}"
        worker_args = ["worker", "--port", str(worker_port), "--threads", "1"]
        with started(worker_args, env, worker_port, tmp_path / "worker.log") as worker:
            body = {
                "model": "smollm2:135m",
                "prompt": PROMPT,
                "stream": True,
                "options": {**GREEDY, "num_predict": 400, "ignore_eos": True},
            }
            lines = []
            with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    lines.append(json.loads(line))
                    if len(lines) == 3:
                        worker.send_signal(signal.SIGSTOP)
            assert f"RPC worker at 127.0.0.1:{worker_port}" in lines[-1].get("error", ""), lines[-1]
            assert "did not answer within 10 s" in lines[-1]["error"]
            assert len(_generate(url, rpc="")) > 0 and server.poll() is None
            stalled = httpx.post(
                f"{url}/api/generate",
                timeout=60,
                json={"model": "smollm2:135m", "prompt": "Hi", "stream": False, "options": GREEDY},
            )
            assert stalled.status_code == 200, stalled.text  # it fits here: served here while the worker is gone
            assert _running(url)["missing_workers"] == [f"127.0.0.1:{worker_port}"]
            worker.send_signal(signal.SIGCONT)
            _wait_until_unloaded(url)
            assert len(_generate(url)) > 0
            ps = httpx.get(f"{url}/api/ps").json()["models"][0]
            assert any(p["device"].startswith("RPC") for p in ps["placement"]), ps["placement"]
            assert worker.poll() is None


def test_an_unreachable_worker_is_one_clear_error(home, tmp_path):
    port = free_port()  # nothing listens there
    server_port = free_port()
    env = _child_env(home, LOCALLLM_HOST=f"127.0.0.1:{server_port}")
    with started(["serve"], env, server_port, tmp_path / "server.log") as server:
        url = f"http://127.0.0.1:{server_port}"
        options = {**GREEDY, "rpc": f"127.0.0.1:{port}"}
        response = httpx.post(
            f"{url}/api/generate",
            timeout=60,
            json={"model": "smollm2:135m", "prompt": "Hi", "stream": False, "options": options},
        )
        assert response.status_code == 503
        assert f"cannot reach the RPC worker at 127.0.0.1:{port}" in response.json()["error"]
        bad = httpx.post(
            f"{url}/api/generate",
            timeout=60,
            json={"model": "smollm2:135m", "prompt": "Hi", "stream": False, "options": {"rpc": "no-port"}},
        )
        assert bad.status_code == 400 and "rpc" in bad.json()["error"]
        assert server.poll() is None


def test_plan_shows_the_split_per_device(home, tmp_path, monkeypatch):
    worker_port = free_port()
    env = _child_env(home)
    with started(["worker", "--port", str(worker_port), "--threads", "1"], env, worker_port, tmp_path / "w.log"):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "localllm",
                "plan",
                "smollm2:135m",
                "--num-gpu",
                "12",
                "--rpc",
                f"127.0.0.1:{worker_port}",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    placement = json.loads(result.stdout)["placement"]
    assert placement["n_gpu_layers"] == 12
    assert [(d["device"], d["layers"]) for d in placement["devices"]] == [("CPU", 19), ("RPC0", 12)]


def test_worker_without_rpc_in_the_build_names_the_rebuild_command(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_supports_rpc", lambda: False)
    result = CliRunner().invoke(app, ["worker", "--port", str(free_port())])
    assert result.exit_code == 1
    assert "bash scripts/setup.sh" in result.output and "-DGGML_RPC=ON" in result.output


def test_worker_warns_when_bound_beyond_loopback(home):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the warning comes first, then binding fails, so the
    # test never opens an unauthenticated port beyond loopback.
    result = subprocess.run(
        [sys.executable, "-m", "localllm", "worker", "--host", "192.0.2.1", "--port", str(free_port())],
        env=_child_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "WARNING" in result.stderr and "no authentication" in result.stderr
    assert result.returncode == 1 and "could not listen on 192.0.2.1" in result.stderr
