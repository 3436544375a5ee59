"""``VERL_LOGGING_LEVEL`` and the ``verl`` logger of Ray worker processes (``verl/utils/logging_setup.py``).

The handler case runs in a fresh interpreter (logging's state is process-wide; pytest's own handlers sit on the
root logger here): a worker host is built as Ray builds it in a worker process, then a ``verl.*`` logger logs at
each level under several settings, and stderr shows what Ray would forward to the driver's console.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import logging, os
from verl.single_controller.ray_worker_group import WorkerHost
from verl.utils.logging_setup import configure_verl_logging
log = logging.getLogger("verl.workers.example")
def lines(tag):
    log.debug("%s debug", tag)
    log.info("%s info", tag)
    log.warning("%s warning", tag)
WorkerHost()  # no VERL_LOGGING_LEVEL: INFO
lines("default")
for value in ("debug", "WARN", "error"):
    os.environ["VERL_LOGGING_LEVEL"] = value
    configure_verl_logging()
    lines(value)
os.environ["VERL_LOGGING_LEVEL"] = "LOUD"
try:
    configure_verl_logging()
except ValueError as err:
    print("refused:", err, file=__import__("sys").stderr)
print("handlers:", len(logging.getLogger("verl").handlers), file=__import__("sys").stderr)
"""


def test_a_worker_process_prints_verl_lines_at_the_configured_level():
    env = {k: v for k, v in os.environ.items() if k != "VERL_LOGGING_LEVEL"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "verl.workers.example" in line] == [
        "INFO verl.workers.example: default info",
        "WARNING verl.workers.example: default warning",
        "DEBUG verl.workers.example: debug debug",
        "INFO verl.workers.example: debug info",
        "WARNING verl.workers.example: debug warning",
        "WARNING verl.workers.example: WARN warning",
    ]
    assert "refused: VERL_LOGGING_LEVEL='LOUD': expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in proc.stderr
    assert "handlers: 1" in proc.stderr  # configured again: the level changes, no second handler
