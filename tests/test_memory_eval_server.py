"""Quickstart and the evaluation harness against a real vLLM (CPU build) server with the tiny model.

One module-scoped server, started through ``serve.vllm_server`` (so the launcher and its /health
wait are exercised too); startup takes ~30-60 s on 2 cores. The tiny model is random, so the tests
check structure (every item accounted for, files written, lenient and strict columns, PNG), not
accuracy.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_model_path, tmp_path_factory):
    from serve.vllm_server import ServerSpec, VLLMServerGroup

    spec = ServerSpec(
        model_path=str(tiny_model_path),
        served_model_name="tiny",
        port=_free_port(),
        device="cpu",
        max_model_len=4096,
        dtype="float32",
        enforce_eager=True,
        env=SERVER_ENV,
    )
    group = VLLMServerGroup(spec, tmp_path_factory.mktemp("vllm_logs"))
    group.start()
    try:
        group.wait_ready(timeout=300)
        yield group.base_urls[0]
    finally:
        group.stop()


def test_quickstart_cli_against_vllm(vllm_server, tiny_model_path):
    env = {**os.environ, **SERVER_ENV, "URL": vllm_server}
    env.pop("API_KEY", None)
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
    argv = ["--model", "tiny", "--base-url", vllm_server, "--tokenizer", str(tiny_model_path),
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
