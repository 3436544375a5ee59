"""Quickstart and the evaluation harness against a real vLLM (CPU build) server with the tiny model.

One module-scoped server, started through ``serve.vllm_server`` (so the launcher and its /health
wait are exercised too) with an API key; startup takes ~30-60 s on 2 cores. The clients send the
key as users of a keyed server do (``API_KEY`` / ``--api-key``); the key's own checks (401 without
it, on no command line and in no log) are ``test_real_vllm_server_requires_the_key_it_got_from_the_environment``
(here rather than in test_serve_signals.py: one vLLM start-up for both). The tiny model is random,
so the tests check structure (every item accounted for, files written, lenient and strict columns,
PNG), not accuracy.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
KEY = "sk-test-3f9a1c77e2b04d5e"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Records(logging.Handler):
    """What ``serve.vllm_server`` logs while the module's server starts (caplog is per test)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path, tmp_path_factory):
    """The module's vLLM server, started by VLLMServerGroup with the API key ``KEY``; yields the group and what
    the launcher logged. After it stops, its log (shutdown included) must not hold the key either."""
    from serve.vllm_server import ServerSpec, VLLMServerGroup

    spec = ServerSpec(
        model_path=str(tiny_model_path),
        served_model_name="tiny",
        port=_free_port(),
        device="cpu",
        max_model_len=4096,
        dtype="float32",
        enforce_eager=True,
        api_key=KEY,
        env=SERVER_ENV,
    )
    group = VLLMServerGroup(spec, tmp_path_factory.mktemp("vllm_logs"))
    records, launcher = _Records(), logging.getLogger("serve.vllm_server")
    level = launcher.level
    launcher.addHandler(records)
    launcher.setLevel(logging.INFO)
    try:
        group.start()
        group.wait_ready(timeout=300)
    except BaseException:
        group.stop()
        raise
    finally:
        launcher.removeHandler(records)
        launcher.setLevel(level)
    try:
        yield group, records.lines
    finally:
        group.stop()
    if KEY in group.log_paths[0].read_text():
        pytest.fail(f"the API key is in the vLLM server's log {group.log_paths[0]}")


@pytest.fixture(scope="module")
def vllm_server(keyed_server) -> str:
    return keyed_server[0].base_urls[0]


def test_real_vllm_server_requires_the_key_it_got_from_the_environment(keyed_server):
    """vLLM (CPU build) started by VLLMServerGroup with an API key: requests without it get 401, with it 200;
    the key is on no command line and in no log the launcher writes (nor vLLM's own, checked again after it
    stops by the fixture)."""
    import urllib.error
    import urllib.request

    import psutil

    from serve.vllm_server import API_KEY_ENV

    group, logged = keyed_server
    (server,) = group.processes
    assert KEY not in " ".join(psutil.Process(server.pid).cmdline())
    url = group.base_urls[0] + "/models"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(url, timeout=10)
    assert denied.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["data"][0]["id"] == "tiny"
    text = "\n".join(logged)
    assert KEY not in text and f"{API_KEY_ENV}=***" in text
    assert KEY not in group.log_paths[0].read_text()  # vLLM itself does not log it either


def test_quickstart_cli_against_vllm(vllm_server, tiny_model_path):
    env = {**os.environ, **SERVER_ENV, "URL": vllm_server, "API_KEY": KEY}
    cmd = [sys.executable, "quickstart.py", "--model", "tiny", "--tokenizer", str(tiny_model_path), "--chunk-size", "200",
           "--max-memory-tokens", "24", "--max-final-tokens", "24"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    n_chunks = out.count("[chunk ")
    assert n_chunks >= 2 and f"[chunk {n_chunks}/{n_chunks}]" in out and "memory is now:" in out
    assert "final response:" in out and "\nanswer: " in out and f"({n_chunks} chunks, {n_chunks + 1} requests" in out


def test_quickstart_wrong_model_against_vllm(vllm_server, monkeypatch, capsys):
    import quickstart

    monkeypatch.setenv("URL", vllm_server)
    monkeypatch.setenv("API_KEY", KEY)
    assert quickstart.main(["--model", "not-tiny"]) == 2
    assert "available: tiny" in capsys.readouterr().err


def _write_dataset(root: Path) -> None:
    paragraphs = [
        f"Paragraph {i}: the river {name} flows past the town of {town} and joins the sea near {sea}."
        for i, (name, town, sea) in enumerate(
            [("Tarn", "Brennock", "Saltmere"), ("Ouse", "Calder", "Harrow"), ("Lune", "Ellery", "Vasse")] * 6
        )
    ]
    for docs in (3, 6):
        rows = []
        for q in range(3):
            context = "\n\n".join(
                f"Document {d + 1}:\n" + " ".join(paragraphs[(q + d) % 18 : (q + d) % 18 + 3]) for d in range(docs)
            )
            rows.append({"context": context, "input": f"Which town does river number {q} pass?", "answers": ["Brennock"],
                         "num_docs": docs, "index": q})  # fmt: skip
        (root / f"eval_{docs}.json").write_text(json.dumps(rows))
    niah = [{"index": i, "input": "What is the special magic number for tiny-river mentioned in the provided text?",
             "context": " ".join(paragraphs) + f" One of the special magic numbers for tiny-river is: 12345{i}.",
             "outputs": [f"12345{i}"], "length": 512} for i in range(2)]  # fmt: skip
    (root / "eval_niah_single_1_512.json").write_text(json.dumps(niah))


def test_eval_harness_against_vllm(vllm_server, tiny_model_path, tmp_path, capsys):
    from taskutils.memory_eval import run as eval_run

    data = tmp_path / "data"
    data.mkdir()
    _write_dataset(data)
    out = tmp_path / "results"
    argv = ["--model", "tiny", "--base-url", vllm_server, "--api-key", KEY, "--tokenizer", str(tiny_model_path),
            "--methods", "recurrent", "recurrent-boxed", "openai", "--tasks", "hotpotqa", "niah_single_1",
            "--data-root", str(data), "--out", str(out), "--chunk-size", "256", "--max-memory-tokens", "24",
            "--max-final-tokens", "24", "--max-input-tokens", "1500", "--max-output-tokens", "24",
            "--concurrency", "8", "--timeout", "120", "--no-progress"]  # fmt: skip
    # hotpotqa lengths 3 and 6 documents; niah at 512 tokens
    # hotpotqa's two cells run at once (--parallel-cells); the results must be the same complete set
    argv_h = (
        argv[: argv.index("--tasks")]
        + ["--tasks", "hotpotqa", "--lengths", "3", "6", "--parallel-cells", "2"]
        + argv[argv.index("--data-root") :]
    )
    argv_n = (
        argv[: argv.index("--tasks")]
        + ["--tasks", "niah_single_1", "--lengths", "512"]
        + argv[argv.index("--data-root") :]
    )
    assert eval_run.main(argv_h) == 0
    assert eval_run.main(argv_n) == 0
    capsys.readouterr()

    with (out / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 * 3  # 3 methods x (hotpotqa 3, 6 docs + niah 512)
    for row in rows:
        expected = 2 if row["task"] == "niah_single_1" else 3
        assert (int(row["n_items"]), int(row["n_ok"]), int(row["n_failed"]), int(row["n_missing"])) == (
            expected,
            expected,
            0,
            0,
        )
        for metric in ("em", "sub_em", "f1", "string_match_all", "strict_boxed"):
            assert 0.0 <= float(row[metric]) <= 100.0
    records = [json.loads(line) for line in (out / "hotpotqa_6" / "tiny-recurrent.jsonl").read_text().splitlines()]
    assert sorted(r["_id"] for r in records) == [0, 1, 2]
    assert all(r["status"] == "ok" and r["num_chunks"] >= 2 and r["requests"] == r["num_chunks"] + 1 for r in records)
    direct = [json.loads(line) for line in (out / "hotpotqa_6" / "tiny-openai.jsonl").read_text().splitlines()]
    assert all(r["requests"] == 1 and r["num_chunks"] == 0 for r in direct)
    markdown = (out / "summary.md").read_text()
    assert "## hotpotqa" in markdown and "## niah_single_1" in markdown
    assert (
        "sub_em (lenient)" in markdown
        and "string_match_all (lenient)" in markdown
        and "strict_boxed (strict)" in markdown
    )
    assert (out / "accuracy_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
