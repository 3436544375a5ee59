"""Level and handler of the ``verl`` loggers in Ray worker processes.

Nothing configured Python logging in the Ray workers, so their INFO lines (the attention, liger and compile_layers
choices, LoRA, checkpoint saves, the rollout engine's stream) were dropped: Python's last-resort handler prints
WARNING and above only. :func:`configure_verl_logging` runs as each worker process starts
(``verl.single_controller.ray_worker_group.WorkerHost``): the ``verl`` logger gets the level of the environment
variable ``VERL_LOGGING_LEVEL`` (DEBUG, INFO, WARNING, ERROR or CRITICAL; default INFO) and, when neither it nor the
root logger has a handler yet, one that writes to stderr (Ray forwards a worker's stderr to the driver's console,
prefixed with the worker's name and pid). The driver's own logging is Hydra's (``main_ppo``) or the caller's.
"""

from __future__ import annotations

import logging
import os

__all__ = ["LEVEL_ENV", "configure_verl_logging"]

LEVEL_ENV = "VERL_LOGGING_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_verl_logging(default: str = "INFO") -> None:
    """Set the ``verl`` logger's level from ``VERL_LOGGING_LEVEL`` (else ``default``) and give it a stderr handler
    when no handler would print its records. Calling it again changes the level only."""
    name = os.environ.get(LEVEL_ENV, default).strip().upper()
    if name == "WARN":
        name = "WARNING"
    if name not in _LEVELS:
        raise ValueError(f"{LEVEL_ENV}={os.environ.get(LEVEL_ENV)!r}: expected one of {', '.join(_LEVELS)}")
    logger = logging.getLogger("verl")
    logger.setLevel(name)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
