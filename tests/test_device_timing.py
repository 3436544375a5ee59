"""``benchmarks/device_timing.py``: which calls are timed, and whether a compile landed in them.

``timed_with_graphs`` is what tells a benchmark's timed calls from torch.compile's automatic-dynamic recompile: the
first shape compiles a static graph, the first new shape a dynamic one. With one warm-up call, the recompile lands in
the first timed call (``bench_update_policy.py`` measured flex_attention's log-prob pass ~4x too slow that way on a
GPU); with two warm-up calls on different shapes it does not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from device_timing import add_warmup_calls_argument, compiled_graphs, timed, timed_with_graphs  # noqa: E402


def test_timed_runs_the_warmup_calls_untimed_then_the_timed_ones():
    calls = []

    def call(i: int):  # warm-up calls take 0.3 s, timed ones 0.02 s: the mean must leave the former out
        calls.append(i)
        time.sleep(0.3 if i < 2 else 0.02)

    seconds = timed(call, steps=3, device=torch.device("cpu"), warmup=2)
    assert calls == [0, 1, 2, 3, 4]
    assert 0.02 <= seconds < 0.1
    calls.clear()
    timed(calls.append, steps=2, device=torch.device("cpu"))  # one warm-up call by default
    assert calls == [0, 1, 2]


def _compiled_calls(lengths: list[int]):
    """A fresh compiled function (Dynamo graphs, no inductor) and a call per index on a tensor of that length."""
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def double_sum(x):
        return (x * 2).sum()

    return lambda i: double_sum(torch.ones(lengths[i]))


def test_timed_with_graphs_counts_a_dynamic_recompile_in_the_timed_calls():
    # one warm-up call: the first new length (5) recompiles, dynamically, inside the timed calls
    _, graphs = timed_with_graphs(_compiled_calls([4, 5, 6, 7]), steps=3, device=torch.device("cpu"), warmup=1)
    assert graphs == 1
    # two warm-up calls on two lengths: both graphs are made before the timer starts
    _, graphs = timed_with_graphs(_compiled_calls([4, 5, 6, 7]), steps=2, device=torch.device("cpu"), warmup=2)
    assert graphs == 0
    before = compiled_graphs()
    _compiled_calls([8])(0)
    assert compiled_graphs() == before + 1


def test_the_warmup_calls_argument_defaults_to_two_and_refuses_less_than_one(capsys):
    parser = argparse.ArgumentParser()
    add_warmup_calls_argument(parser)
    assert parser.parse_args([]).warmup_calls == 2 and parser.parse_args(["--warmup-calls", "1"]).warmup_calls == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup-calls", "0"])
    assert "--warmup-calls: must be >= 1, got 0" in capsys.readouterr().err
