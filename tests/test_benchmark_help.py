"""Every benchmark script answers ``--help`` with its usage and exit status 0 (argparse formats each help string
with ``%``: a bare ``%`` in one made ``--help`` crash)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# the scripts (the helper modules beside them have no __main__ block)
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_benchmark_script_is_covered():
    assert len(SCRIPTS) >= 19 and BENCHMARKS / "bench_update_policy.py" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_exits_0(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert stop.value.code in (0, None), out
    # argparse's usage line, or (suite_tables) the module docstring with its command line
    assert out.lower().startswith("usage:") or f"python benchmarks/{script.name}" in out, out[:500]
