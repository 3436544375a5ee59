"""Crash-safe checkpoint folders: ``<root>/global_step_N/``, the ``latest`` pointer, pruning, resume resolution.

A save writes everything into ``<root>/.tmp_global_step_N_<pid>/`` (the caller's ``write_fn`` does the writing,
e.g. by asking every FSDP rank to ``save_model_shards`` into ``tmp/actor``), fsyncs the files, writes the
``COMPLETE`` marker (JSON metadata: step, time, world size, ...), fsyncs again and only then renames the folder
to ``<root>/global_step_N`` (one atomic ``rename``). Afterwards ``latest_checkpointed_iteration.txt`` (verl's
name; it holds the step number) is replaced atomically and the oldest complete checkpoints beyond
``max_ckpt_to_keep`` are deleted. A crash at any point therefore leaves either no ``global_step_N`` folder or a
complete one; readers trust only folders that carry the ``COMPLETE`` marker, whatever the text file says.

Resume modes (``trainer.resume_mode``): ``auto`` (newest complete checkpoint under the root, or a fresh start
when there is none), ``disable`` (always fresh), ``resume_path`` (the folder in ``trainer.resume_from_path``),
or a checkpoint folder given directly as the mode value. "Newest" means the largest step ``N``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

__all__ = [
    "COMPLETE_MARKER",
    "LATEST_ITERATION_FILE",
    "CheckpointError",
    "CheckpointManager",
    "atomic_write_text",
    "is_complete_checkpoint",
    "read_checkpoint_meta",
    "validate_checkpoint_dir",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
LATEST_ITERATION_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR_PREFIX = "global_step_"
RESUME_MODES = ("auto", "disable", "resume_path")

_STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
# Work folders of a save (.tmp_), a replaced checkpoint (.old_) and a pruned one (.del_); all end in _<pid>.
_WORK_DIR_RE = re.compile(r"^\.(tmp|old|del)_global_step_(\d+)_(\d+)$")

PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """A folder is not a (complete) checkpoint, or a resume setting is invalid."""


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories: best effort, not every platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder, fsync, then ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def read_checkpoint_meta(ckpt_dir: PathLike) -> dict[str, Any]:
    """The ``COMPLETE`` marker's metadata of a checkpoint folder; ``CheckpointError`` when it is missing or
    unreadable (i.e. the folder is not a complete checkpoint)."""
    marker = Path(ckpt_dir) / COMPLETE_MARKER
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint: no {COMPLETE_MARKER} marker") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt_dir}: unreadable {COMPLETE_MARKER} marker ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{marker}: expected a JSON object with an integer 'step', got {meta!r}")
    return meta


def is_complete_checkpoint(ckpt_dir: PathLike) -> bool:
    """True when ``ckpt_dir`` is a folder with a readable ``COMPLETE`` marker."""
    try:
        read_checkpoint_meta(ckpt_dir)
    except CheckpointError:
        return False
    return Path(ckpt_dir).is_dir()


def validate_checkpoint_dir(path: PathLike) -> Path:
    """Return ``path`` (absolute) if it is a complete checkpoint folder, else raise with a hint.

    Raises ``FileNotFoundError`` when it does not exist, ``CheckpointError`` when it is not complete.
    """
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise FileNotFoundError(f"resume checkpoint {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"resume checkpoint {p} is not a directory")
    if is_complete_checkpoint(p):
        return p
    hint = ""
    if _WORK_DIR_RE.match(p.name):
        hint = " (it is the work folder of an interrupted save or delete; it may be half-written)"
    elif is_complete_checkpoint(p.parent):
        hint = f" (its parent {p.parent} is one: pass that folder)"
    else:
        inside = CheckpointManager(p).find_latest()
        if inside is not None:
            hint = (
                f" (it looks like a checkpoint root; pass one of its global_step_N folders, e.g. {inside}, "
                "or use resume_mode=auto with this folder as trainer.default_local_dir)"
            )
    raise CheckpointError(f"resume checkpoint {p} is not a complete checkpoint: no {COMPLETE_MARKER} marker{hint}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointManager:
    """Saves, finds and prunes ``global_step_N`` checkpoint folders under ``root_dir``.

    Args:
        root_dir: ``trainer.default_local_dir``.
        max_ckpt_to_keep: keep at most this many complete checkpoints (``None`` or ``<= 0``: keep all).
        fsync: fsync every written file before the checkpoint becomes visible (turn off only for tests on
            throw-away folders).
    """

    def __init__(self, root_dir: PathLike, max_ckpt_to_keep: Optional[int] = None, fsync: bool = True) -> None:
        self.root = Path(root_dir).expanduser().absolute()
        self.max_ckpt_to_keep = int(max_ckpt_to_keep) if max_ckpt_to_keep else None
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep <= 0:
            self.max_ckpt_to_keep = None
        self.fsync = fsync

    # ------------------------------------------------------------------ paths and listing
    def step_dir(self, step: int) -> Path:
        """``<root>/global_step_<step>`` (whether or not it exists)."""
        return self.root / f"{STEP_DIR_PREFIX}{int(step)}"

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, folder)`` of every complete checkpoint, oldest step first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR_RE.match(child.name)
            if match and is_complete_checkpoint(child):
                found.append((int(match.group(1)), child))
        return sorted(found)

    def find_latest(self) -> Optional[Path]:
        """The complete checkpoint with the largest step, or ``None``. Folders without the ``COMPLETE`` marker
        and save work folders are ignored, even when ``latest_checkpointed_iteration.txt`` names them."""
        checkpoints = self.list_checkpoints()
        return checkpoints[-1][1] if checkpoints else None

    def read_latest_iteration(self) -> Optional[int]:
        """The step in ``latest_checkpointed_iteration.txt`` (``None`` when absent or unparsable); informative
        only: ``find_latest`` decides what to resume from."""
        try:
            return int((self.root / LATEST_ITERATION_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ saving
    def save(
        self, step: int, write_fn: Callable[[Path], Any], world_size: int = 1, metadata: Optional[dict[str, Any]] = None
    ) -> Path:
        """Write checkpoint ``step`` atomically and return its final folder ``<root>/global_step_<step>``.

        ``write_fn(tmp_dir)`` writes the checkpoint's contents into ``tmp_dir`` (it must return only when every
        writer, e.g. every FSDP rank, has finished). If it raises, the work folder is removed and the exception
        propagates; no ``global_step_<step>`` appears. An existing ``global_step_<step>`` is replaced.
        ``metadata`` (JSON-serialisable) is added to the ``COMPLETE`` marker next to step, time and world size.
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_stale_work_dirs()
        pid = os.getpid()
        tmp = self.root / f".tmp_{STEP_DIR_PREFIX}{step}_{pid}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            write_fn(tmp)
            meta = {
                "step": step,
                "time": time.time(),
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "world_size": int(world_size),
                "hostname": socket.gethostname(),
                "pid": pid,
            }
            meta.update(metadata or {})
            meta["step"] = step
            if self.fsync:
                _fsync_tree(tmp)
            with open(tmp / COMPLETE_MARKER, "w") as fh:
                json.dump(meta, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_path(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

        final = self.step_dir(step)
        if final.exists():  # e.g. a run resumed from an older checkpoint reaches this step again
            old = self.root / f".old_{STEP_DIR_PREFIX}{step}_{pid}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_path(self.root)
        atomic_write_text(self.root / LATEST_ITERATION_FILE, f"{step}\n")
        newer = [s for s, _ in self.list_checkpoints() if s > step]
        if newer:
            logger.warning(
                "saved global_step_%d but checkpoints with larger steps exist (%s); resume_mode=auto "
                "will pick global_step_%d",
                step,
                newer,
                max(newer),
            )
        self.prune(keep=final)
        logger.info("checkpoint saved: %s", final)
        return final

    def prune(self, keep: Optional[Path] = None) -> list[Path]:
        """Delete the oldest complete checkpoints so that at most ``max_ckpt_to_keep`` remain, never ``keep``.
        Each is first renamed to a work folder (so a crash mid-delete never leaves a marked, partial
        checkpoint). Returns the deleted folders."""
        if self.max_ckpt_to_keep is None:
            return []
        checkpoints = self.list_checkpoints()
        excess = len(checkpoints) - self.max_ckpt_to_keep
        keep_abs = Path(keep).absolute() if keep is not None else None
        deletable = [path for _, path in checkpoints if path.absolute() != keep_abs]
        deleted = []
        for path in deletable[: max(0, excess)]:
            doomed = self.root / f".del_{path.name}_{os.getpid()}"
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(path)
            logger.info("pruned checkpoint %s (max_ckpt_to_keep=%d)", path, self.max_ckpt_to_keep)
        return deleted

    def remove_stale_work_dirs(self) -> list[Path]:
        """Remove ``.tmp_/.old_/.del_global_step_N_<pid>`` folders left by processes of this host that no longer
        run (crashed saves); folders of live processes are left alone. Returns the removed folders."""
        removed = []
        if not self.root.is_dir():
            return removed
        for child in self.root.iterdir():
            match = _WORK_DIR_RE.match(child.name)
            if match and child.is_dir() and not _pid_alive(int(match.group(3))):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        return removed

    # ------------------------------------------------------------------ resuming
    def resolve_resume(self, resume_mode: Optional[str], resume_from_path: Optional[PathLike] = None) -> Optional[Path]:
        """The checkpoint folder to resume from, or ``None`` for a fresh start.

        * ``"auto"``: ``find_latest()`` (``None`` when the root holds no complete checkpoint);
        * ``"disable"``: ``None``;
        * ``"resume_path"``: ``resume_from_path``, which must be a complete checkpoint;
        * anything else is taken as a checkpoint folder path.

        Raises ``FileNotFoundError`` for a path that does not exist and ``CheckpointError`` for a folder that is
        not a complete checkpoint or an invalid mode.
        """
        mode = "" if resume_mode is None else str(resume_mode).strip()
        if mode == "disable":
            return None
        if mode == "auto":
            latest = self.find_latest()
            if latest is None:
                logger.info("resume_mode=auto: no complete checkpoint under %s, starting from scratch", self.root)
            return latest
        if mode == "resume_path":
            if resume_from_path is None or str(resume_from_path).strip() == "":
                raise CheckpointError(
                    "trainer.resume_mode='resume_path' needs trainer.resume_from_path "
                    "(a global_step_N checkpoint folder)"
                )
            return validate_checkpoint_dir(resume_from_path)
        if mode == "":
            raise CheckpointError(
                f"trainer.resume_mode is empty; valid: {', '.join(RESUME_MODES)}, or a checkpoint folder path"
            )
        if os.sep not in mode and not mode.startswith(("~", ".")) and not os.path.exists(mode):
            raise CheckpointError(
                f"unknown trainer.resume_mode '{mode}'; valid: {', '.join(RESUME_MODES)} "
                "(with trainer.resume_from_path), or a checkpoint folder path"
            )
        return validate_checkpoint_dir(mode)

    @staticmethod
    def step_of(ckpt_dir: PathLike) -> int:
        """The step recorded in a complete checkpoint's marker."""
        return int(read_checkpoint_meta(ckpt_dir)["step"])
