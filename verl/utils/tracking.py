"""Experiment loggers behind one object: ``Tracking(...).log(metrics, step)``.

Backends (``trainer.logger``):

* ``console``: one compact line per step, ``step:3 - actor/lr:1e-06 - critic/score/mean:0.5``; keys sorted,
  floats with 4 significant digits;
* ``wandb``: ``wandb.init(project, name, config, dir)``; honours ``WANDB_MODE`` (``offline`` works without
  network; ``wandb sync`` uploads later);
* ``tensorboard``: scalars through ``torch.utils.tensorboard.SummaryWriter`` under ``<log_dir>/tensorboard``;
* ``jsonl``: one JSON object per step appended to ``<log_dir>/metrics.jsonl`` and flushed + fsynced at once, so
  a crash loses nothing already logged.

``log_dir`` defaults to ``$TRACKING_LOG_DIR`` or ``logs/<project>/<experiment>``; the trainer passes
``trainer.log_dir``.

Reruns and resumes log every step once: the trainer calls :meth:`Tracking.resume_at` with the step it resumed
from (``None`` for a fresh start). ``metrics.jsonl`` and ``val_generations.jsonl`` then keep the lines of steps
up to that step (none on a fresh start) and move the others, which the run is about to redo, to
``<file>.superseded`` (appended, so nothing is lost); a torn last line from a killed writer moves there too.
TensorBoard hides events after that step (``SummaryWriter(purge_step=...)``). wandb starts a new run per
command, so it has nothing to drop.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, TextIO, Union

__all__ = ["Tracking", "VALID_BACKENDS", "drop_superseded_lines", "format_console_line", "to_python_scalar"]

VALID_BACKENDS = ("console", "wandb", "tensorboard", "jsonl")

METRICS_FILE = "metrics.jsonl"
GENERATIONS_FILE = "val_generations.jsonl"


def to_python_scalar(value: Any) -> Any:
    """Convert one-element tensors/arrays and numpy scalars to Python numbers; other values are returned as is."""
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes, Mapping)):
        try:
            return item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            return value
    return value


def _format_value(value: Any) -> str:
    value = to_python_scalar(value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return f"{float(value):.4g}"
    return str(value)


def format_console_line(data: Mapping[str, Any], step: int) -> str:
    """``step:<step> - k1:v1 - k2:v2`` with keys sorted and floats formatted with 4 significant digits."""
    parts = [f"step:{step}"] + [f"{key}:{_format_value(data[key])}" for key in sorted(data)]
    return " - ".join(parts)


def _json_safe(value: Any) -> Any:
    value = to_python_scalar(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _config_to_dict(config: Any) -> Optional[dict]:
    if config is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(config) if isinstance(config, Mapping) else {"config": str(config)}


# --------------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------------


class _ConsoleBackend:
    def __init__(self, stream: Optional[TextIO] = None):
        self.stream = stream

    def log(self, data: Mapping[str, Any], step: int) -> None:
        stream = self.stream or sys.stdout
        print(format_console_line(data, step), file=stream, flush=True)

    def log_generations(self, samples: list[dict], step: int) -> None:
        stream = self.stream or sys.stdout
        for i, sample in enumerate(samples):
            print(
                f"[val-generation step:{step} #{i}] {json.dumps(_json_safe(sample), ensure_ascii=False)}",
                file=stream,
                flush=True,
            )

    def finish(self) -> None:
        pass


class _JsonlBackend:
    def __init__(self, log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / METRICS_FILE
        self.generations_path = log_dir / GENERATIONS_FILE
        self._file: Optional[TextIO] = open(self.path, "a", encoding="utf-8")

    @staticmethod
    def _append(file: TextIO, record: dict) -> None:
        file.write(json.dumps(record, ensure_ascii=False) + "\n")
        file.flush()
        os.fsync(file.fileno())

    def log(self, data: Mapping[str, Any], step: int) -> None:
        if self._file is None:
            raise RuntimeError(f"jsonl logger for {self.path} is already finished")
        self._append(self._file, {"step": step, **{k: _json_safe(v) for k, v in data.items()}})

    def log_generations(self, samples: list[dict], step: int) -> None:
        with open(self.generations_path, "a", encoding="utf-8") as file:
            for sample in samples:
                self._append(file, {"step": step, **_json_safe(dict(sample))})

    def resume_at(self, step: Optional[int]) -> None:
        if self._file is not None:
            self._file.close()
        for path in (self.path, self.generations_path):
            drop_superseded_lines(path, step)
        self._file = open(self.path, "a", encoding="utf-8")

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def drop_superseded_lines(path: Path, step: Optional[int]) -> int:
    """Keep the JSON lines of ``path`` whose ``"step"`` is <= ``step`` (none when ``step`` is None), move the rest
    (and lines that do not parse) to ``<path>.superseded``; atomic (temporary file + ``os.replace``). Returns the
    number of lines moved."""
    if not path.exists():
        return 0
    kept, dropped = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            line_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            line_step = None
        keep = step is not None and isinstance(line_step, int) and line_step <= step
        (kept if keep else dropped).append(line)
    if not dropped:
        return 0
    superseded = path.with_name(path.name + ".superseded")
    with open(superseded, "a", encoding="utf-8") as file:
        file.write("".join(line + "\n" for line in dropped))
        file.flush()
        os.fsync(file.fileno())
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        file.write("".join(line + "\n" for line in kept))
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    where = "a fresh start" if step is None else f"resuming at step {step}"
    print(f"[tracking] {where}: moved {len(dropped)} line(s) of {path} to {superseded}", flush=True)
    return len(dropped)


class _TensorboardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = log_dir / "tensorboard"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for key, value in data.items():
            value = to_python_scalar(value)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()

    def log_generations(self, samples: list[dict], step: int) -> None:
        text = "\n\n".join(json.dumps(_json_safe(s), ensure_ascii=False) for s in samples)
        self.writer.add_text("val/generations", text, global_step=step)
        self.writer.flush()

    def resume_at(self, step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()  # TensorBoard hides the events of steps >= purge_step written before this one
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=0 if step is None else step + 1)

    def finish(self) -> None:
        self.writer.close()


class _WandbBackend:
    def __init__(self, project_name: str, experiment_name: str, config: Optional[dict], log_dir: Optional[Path]):
        import wandb

        kwargs: dict[str, Any] = {"project": project_name, "name": experiment_name, "config": config}
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(log_dir)
        self._wandb = wandb
        self.run = wandb.init(**kwargs)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self.run.log({k: to_python_scalar(v) for k, v in data.items()}, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        if not samples:
            return
        columns = sorted({key for sample in samples for key in sample})
        rows = [[_json_safe(sample.get(c)) for c in columns] for sample in samples]
        self.run.log({"val/generations": self._wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()


# --------------------------------------------------------------------------------------------------
# Tracking
# --------------------------------------------------------------------------------------------------


class Tracking:
    """Fan metrics out to the configured backends.

    Args:
        project_name: project (wandb project; part of the default log folder).
        experiment_name: run name.
        default_backend: a backend name or a list of them, from ``console``, ``wandb``, ``tensorboard``, ``jsonl``.
        config: the run config (DictConfig or dict), recorded by wandb.
        log_dir: folder for ``metrics.jsonl``, ``tensorboard/`` and wandb's run folder.
        console_stream: where the console backend prints (default: ``sys.stdout`` at print time).
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: Union[str, Iterable[str]] = "console",
        config: Any = None,
        log_dir: Union[str, os.PathLike, None] = None,
        console_stream: Optional[TextIO] = None,
    ):
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend or [])
        unknown = [b for b in backends if b not in VALID_BACKENDS]
        if unknown:
            raise ValueError(f"unknown logger backend(s) {unknown}; valid: {', '.join(VALID_BACKENDS)}")
        self.project_name = project_name
        self.experiment_name = experiment_name
        if log_dir is None:
            log_dir = os.environ.get("TRACKING_LOG_DIR") or os.path.join("logs", project_name, experiment_name)
        self.log_dir = Path(log_dir)
        self.backends: dict[str, Any] = {}
        for name in dict.fromkeys(backends):  # de-duplicate, keep order
            if name == "console":
                self.backends[name] = _ConsoleBackend(console_stream)
            elif name == "jsonl":
                self.backends[name] = _JsonlBackend(self.log_dir)
            elif name == "tensorboard":
                self.backends[name] = _TensorboardBackend(self.log_dir)
            elif name == "wandb":
                self.backends[name] = _WandbBackend(
                    project_name, experiment_name, _config_to_dict(config), self.log_dir
                )

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics to every backend (non-finite floats are kept; JSON writes them as NaN)."""
        for backend in self.backends.values():
            backend.log(data, step)

    def resume_at(self, step: Optional[int]) -> None:
        """The run continues after ``step`` (``None``: starts fresh): drop what the file backends hold for later
        steps, so they are logged once (see the module docstring)."""
        for backend in self.backends.values():
            resume = getattr(backend, "resume_at", None)
            if callable(resume):
                resume(step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        """Log validation generations (dicts such as ``{"input", "output", "score"}``) where supported."""
        for backend in self.backends.values():
            backend.log_generations(list(samples), step)

    def finish(self) -> None:
        """Close files and end the wandb run; safe to call twice."""
        for backend in self.backends.values():
            backend.finish()
        self.backends = {}

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()

    def __del__(self) -> None:  # best effort: flush files if the owner forgot finish()
        try:
            for name in ("jsonl", "tensorboard"):
                backend = self.backends.get(name)
                if backend is not None:
                    backend.finish()
        except Exception:  # noqa: BLE001
            pass
