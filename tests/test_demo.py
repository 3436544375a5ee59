"""The README's demo command, on the random tiny model (`make demo ARGS=--tiny`): it trains, writes a
checkpoint, a metrics log and a real PNG plot of reward per step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_demo_tiny_runs_end_to_end(tmp_path, tiny_model_path, monkeypatch):
    env = {
        "MEMAGENT_CACHE": str(Path(tiny_model_path).parent),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
    }
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.demo", "--tiny", "--steps", "2", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    png = (out / "reward_per_step.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [0, 1, 2]
    assert (out / "checkpoints" / "global_step_2" / "COMPLETE").exists()
    assert (out / "checkpoints" / "logs" / "metrics.jsonl").read_text().count("\n") >= 3
    assert "[demo] done in" in proc.stdout
