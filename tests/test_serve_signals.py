"""``python -m serve`` supervision and secrets, with real processes.

* SIGTERM (after startup or during it) stops the server child and frees its port; SIGKILL of the launcher
  takes the child down too (PR_SET_PDEATHSIG). The child is the project's in-process server with the HF
  engine on the tiny model, the backend that starts fastest on a CPU machine.
* ``--api-key`` is never printed: not in the echoed command line, the log line, ``--dry-run`` or the error
  that quotes a failed server's log; the child still gets it (``VLLM_API_KEY``). That a real vLLM server started
  with the key requires it is checked in test_memory_eval_server.py, on the server that module starts anyway.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from serve.vllm_server import API_KEY_ENV, LaunchPlan, ServerSpec, VLLMServerGroup, build_launch_plans, main, supervise

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test-3f9a1c77e2b04d5e"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT left by health checks is not a holder
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _child_pid(log: Path) -> int | None:
    found = re.search(r"started server 1/1 \(pid (\d+), port", log.read_text())
    return int(found.group(1)) if found else None


@pytest.mark.parametrize(
    "moment, sig",
    [("ready", signal.SIGTERM), ("starting", signal.SIGTERM), ("ready", signal.SIGKILL)],
    ids=["sigterm-when-ready", "sigterm-during-startup", "sigkill-of-the-launcher"],
)
def test_signal_to_serve_stops_the_child_and_frees_the_port(tiny_model_path, tmp_path, moment, sig):
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "serve", "--backend", "inproc", "--model", str(tiny_model_path), "--port", str(port)]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--timeout", "240", "--engine", "hf"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _child_pid(log) is not None, 120, "the server child", log)
        child = _child_pid(log)
        if moment == "ready":
            _wait(lambda: "ready after" in log.read_text(), 240, "readiness", log)
            assert not _port_is_free(port)  # the child holds it
        assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        _wait(lambda: _gone(child), 30, f"server child {child} to exit", log)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    if sig == signal.SIGTERM:
        assert rc == 0, text[-3000:]
        assert "SIGTERM received: stopping 1 server process(es)" in text and "servers stopped" in text
    else:
        assert rc == -signal.SIGKILL  # no cleanup ran in the launcher: the kernel sent the child SIGTERM
    _wait(lambda: _port_is_free(port), 10, f"port {port} to be free", log)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed KeyboardInterrupt
def test_a_sigint_during_the_inproc_server_start_up_is_kept_even_where_python_swallows_it():
    """serve.inproc_server records a SIGINT that comes while it starts: Python may swallow the KeyboardInterrupt
    (raised in a weakref callback here, as in importlib's module-lock one, seen in a suite run), and the server
    must still stop once it is up (it served until the launcher's SIGKILL 30 s later)."""
    import threading
    import weakref

    from serve.inproc_server import record_sigint

    class Lock:
        pass

    previous = signal.getsignal(signal.SIGINT)
    stop = threading.Event()
    try:
        record_sigint(stop)
        lock = Lock()
        # the signal is handled at the next bytecode boundary: inside the callback, whose exception is ignored
        ref = weakref.ref(lock, lambda _: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))
        try:
            del lock
            time.sleep(0.2)
        except KeyboardInterrupt:  # not swallowed after all: the start-up stops where it is, also fine
            pass
        assert ref() is None and stop.is_set()
        with pytest.raises(KeyboardInterrupt):  # the start-up is interrupted where it is, as by default
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_api_key_reaches_vllm_through_the_environment_and_is_never_printed(tmp_path, capsys, caplog):
    plans = build_launch_plans(ServerSpec("/m", device="cpu", api_key=KEY, port=9300))
    (plan,) = plans
    assert KEY not in plan.cmd and "--api-key" not in plan.cmd  # not on the command line (ps, logs)
    assert plan.env[API_KEY_ENV] == KEY and plan.secrets == (KEY,)
    assert f"{API_KEY_ENV}=***" in plan.display() and KEY not in plan.display()

    assert main(["--model", "/m", "--device", "cpu", "--api-key", KEY, "--dry-run"]) == 0
    out = capsys.readouterr()
    assert KEY not in out.out + out.err and f"{API_KEY_ENV}=***" in out.out

    with pytest.raises(ValueError, match="backend=inproc has no API keys") as err:
        build_launch_plans(ServerSpec("/m", backend="inproc", api_key=KEY))
    assert KEY not in str(err.value)

    # a real child that fails before it is ready and writes the key it got into its log
    child = [sys.executable, "-c", f"import os; print('got key', os.environ[{API_KEY_ENV!r}]); raise SystemExit(3)"]
    spec = ServerSpec("/m", device="cpu", api_key=KEY)
    failing = [LaunchPlan(child, dict(p.env), _free_port(), p.secrets) for p in build_launch_plans(spec)]
    group = VLLMServerGroup(spec, tmp_path, plans=failing)
    with caplog.at_level(logging.INFO, logger="serve.vllm_server"):
        assert supervise(group, timeout=60) == 1
    out = capsys.readouterr()
    assert "exited with code 3" in out.err and "got key ***" in out.err
    assert KEY not in out.out + out.err + caplog.text
    assert f"{API_KEY_ENV}=***" in caplog.text  # the start line shows the environment, redacted
    assert f"got key {KEY}" in (tmp_path / f"vllm-{group.plans[0].port}.log").read_text()  # the child had it


def test_a_local_model_path_that_does_not_exist_is_refused_before_any_server_starts(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as stop:
        main(["--model", str(missing), "--device", "cpu"])
    assert stop.value.code == 2
    assert f"--model {missing}: no such file or folder" in capsys.readouterr().err
    # a dry run prints the commands (for another machine) whatever the path; a hub id is left to the server
    assert main(["--model", str(missing), "--device", "cpu", "--dry-run"]) == 0
    assert main(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--device", "cpu", "--dry-run"]) == 0
