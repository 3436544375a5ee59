"""Tests of taskutils.memory_data: HotpotQA synthesis, answerability filter, RULER tasks, synthetic QA.

Fixtures are tiny invented HotpotQA/SQuAD files (tests/fixtures/memory_data, made by
make_fixtures.py); the tokenizer is a byte-level BPE trained locally in about a second; the
answerability filter talks to a scripted OpenAI-compatible server on 127.0.0.1. Nothing downloads.
"""

from __future__ import annotations

import json
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from taskutils.memory_data import filter_answerable, hotpotqa_synth, synthetic_qa
from taskutils.memory_data.documents import expand_index_context, select_documents
from taskutils.memory_data.io_utils import qa_row, write_parquet, write_sharded_parquet
from taskutils.memory_data.ruler import TASKS
from taskutils.memory_data.ruler import cli as ruler_cli
from taskutils.memory_data.ruler.constants import TOKENS_TO_GENERATE
from taskutils.memory_data.sources import DataFormatError, QAItem, read_hotpotqa, read_squad
from taskutils.memory_data.synthetic_qa import SYNTHETIC_SCHEMA, make_needle_qa_dataset
from taskutils.memory_data.tokens import TokenCounter, fit_largest

FIXTURES = Path(__file__).parent / "fixtures" / "memory_data"
TRAIN = FIXTURES / "hotpot_train.json"
DEV = FIXTURES / "hotpot_dev.json"
SQUAD = FIXTURES / "squad_dev.json"
DOC_HEADER = re.compile(r"^Document (\d+):$", re.M)


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_path: Path) -> Path:
    """The session's tiny model folder: its tokenizer is ``build_tiny_tokenizer``'s (same corpus, same vocabulary
    size), trained once per session instead of once more for this module."""
    return tiny_model_path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_documents(context: str) -> list[str]:
    """Inverse of render_documents (checks the numbering 1..D on the way)."""
    parts = DOC_HEADER.split(context)
    assert parts[0] == ""
    numbers = [int(x) for x in parts[1::2]]
    assert numbers == list(range(1, len(numbers) + 1))
    bodies = [b[1:] if b.startswith("\n") else b for b in parts[2::2]]
    return [b[:-2] if b.endswith("\n\n") else b for b in bodies]


def own_docs(row: dict) -> tuple[list[str], list[str]]:
    """(own documents, supporting documents) of a raw HotpotQA row, in the renderer's format."""
    gold_titles = {f[0] for f in row["supporting_facts"]}
    own = [f"{t}\n{''.join(s)}" for t, s in row["context"]]
    gold = [f"{t}\n{''.join(s)}" for t, s in row["context"] if t in gold_titles]
    return own, gold


# --------------------------------------------------------------------------------------------------
# HotpotQA synthesis
# --------------------------------------------------------------------------------------------------


def run_synth(out: Path, *extra: str) -> Path:
    args = [
        "--train",
        str(TRAIN),
        "--dev",
        str(DEV),
        "--out",
        str(out),
        "--train-docs",
        "50",
        "--dev-docs",
        "40",
        "--eval-lengths",
        "20,50,100,200",
        "--index-only-above",
        "60",
        "--eval-questions",
        "6",
        "--workers",
        "1",
        "--shard-size",
        "7",
        *extra,
    ]
    assert hotpotqa_synth.main(args) == 0
    return out


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_synth(tmp_path_factory.mktemp("hotpot"))


def test_process_parquet_counts_gold_and_schema(synth_dir: Path):
    raw = json.loads(TRAIN.read_text())
    df = pd.read_parquet(synth_dir / "hotpotqa_train_process.parquet")
    assert list(df.columns) == ["data_source", "prompt", "context", "ability", "reward_model", "extra_info"]
    assert len(df) == 30  # all 30 fixture questions (< the 80,000 limit)
    for i, row in df.iterrows():
        src = raw[i]
        docs = split_documents(row["context"])
        assert len(docs) == 50 and len(set(docs)) == 50
        own, gold = own_docs(src)
        assert set(own) <= set(docs)
        info = row["extra_info"]
        assert info["index"] == i and info["num_docs"] == 50 and info["question"] == src["question"]
        assert sorted(docs[p - 1] for p in info["gold_docs"]) == sorted(gold) and len(gold) == 2
        assert src["answer"] in "".join(gold)
        assert row["data_source"] == "hotpotqa" and row["ability"] == "memory"
        assert list(row["prompt"]) == [{"role": "user", "content": src["question"]}]
        assert row["reward_model"]["style"] == "rule" and list(row["reward_model"]["ground_truth"]) == [src["answer"]]
    dev = pd.read_parquet(synth_dir / "hotpotqa_dev_process.parquet")
    assert len(dev) == 24 and all(len(split_documents(c)) == 40 for c in dev["context"])


def test_default_layout_moves_gold_documents(synth_dir: Path):
    df = pd.read_parquet(synth_dir / "hotpotqa_train_process.parquet")
    layouts = {tuple(e["gold_docs"]) for e in df["extra_info"]}
    assert len(layouts) > 10  # 30 samples, gold positions drawn per sample


def test_fixed_layout_reproduces_random4_shuffle(tmp_path: Path):
    out = run_synth(tmp_path, "--fixed-layout", "--stages", "process")
    raw = json.loads(TRAIN.read_text())
    perm = list(range(50))
    random.Random(4).shuffle(perm)  # the original: own docs first, then Random(4).shuffle per sample
    df = pd.read_parquet(out / "hotpotqa_train_process.parquet")
    for i, row in df.iterrows():
        docs = split_documents(row["context"])
        own, _ = own_docs(raw[i])
        for j, doc in enumerate(own):  # own doc j (source order) sits at position perm.index(j)
            assert docs[perm.index(j)] == doc
    own_slots = {perm.index(j) + 1 for j in range(10)}  # the same 10 slots in every sample
    assert all(set(e["gold_docs"]) <= own_slots for e in df["extra_info"])


def test_synthesis_is_deterministic_for_a_seed(tmp_path: Path, synth_dir: Path):
    again = run_synth(tmp_path / "a", "--workers", "2")
    for name in ["hotpotqa_train_process.parquet", "hotpotqa_dev_process.parquet"]:
        pd.testing.assert_frame_equal(pd.read_parquet(synth_dir / name), pd.read_parquet(again / name))
    for d in (20, 50, 100, 200):
        assert (synth_dir / f"eval_{d}.json").read_bytes() == (again / f"eval_{d}.json").read_bytes()
    other = run_synth(tmp_path / "b", "--seed", "7", "--stages", "process")
    assert not pd.read_parquet(synth_dir / "hotpotqa_dev_process.parquet")["context"].equals(
        pd.read_parquet(other / "hotpotqa_dev_process.parquet")["context"]
    )


def test_eval_sets_text_and_index_only(synth_dir: Path):
    dev_raw = json.loads(DEV.read_text())
    pool = read_hotpotqa(DEV).docs
    assert len(pool) == 111
    for d, expect_docs, index_only in [(20, 20, False), (50, 50, False), (100, 100, True), (200, 111, True)]:
        records = json.loads((synth_dir / f"eval_{d}.json").read_text())
        assert [r["index"] for r in records] == list(range(6))
        for r in records:
            assert set(r) == {"context", "input", "answers", "num_docs", "index", "gold_docs"}
            assert r["num_docs"] == expect_docs
            src = dev_raw[r["index"]]
            assert r["input"] == src["question"] and r["answers"] == [src["answer"]]
            if index_only:
                assert isinstance(r["context"], list) and len(set(r["context"])) == expect_docs
            else:
                assert isinstance(r["context"], str)
            docs = split_documents(expand_index_context(r["context"], pool))
            assert len(docs) == expect_docs
            own, gold = own_docs(src)
            assert set(own) <= set(docs) and sorted(docs[p - 1] for p in r["gold_docs"]) == sorted(gold)


def test_eval_questions_from_filtered_file(tmp_path: Path):
    rows = [qa_row("hotpotqa", "q", "c", ["a"], {"index": k}) for k in (5, 2, 17)]
    pd.DataFrame(rows).to_parquet(tmp_path / "hotpotqa_dev.parquet")
    assert (
        hotpotqa_synth.main(
            [
                "--dev",
                str(DEV),
                "--out",
                str(tmp_path),
                "--stages",
                "eval",
                "--eval-lengths",
                "30",
                "--eval-from",
                str(tmp_path / "hotpotqa_dev.parquet"),
            ]
        )
        == 0
    )
    records = json.loads((tmp_path / "eval_30.json").read_text())
    assert [r["index"] for r in records] == [5, 2, 17]
    assert hotpotqa_synth.read_eval_question_indices(tmp_path / "eval_30.json") == [5, 2, 17]


def test_select_documents_prefers_more_then_samples_rest():
    item = QAItem(0, "q0", "q?", ["a"], doc_ids=[3], gold_doc_ids=[3], more_doc_ids=[7, 8, 9])
    rng = random.Random(0)
    small = select_documents(item, 3, 20, rng)  # 1 own + 2 of the 3 "more"
    assert small[0] == 3 and set(small[1:]) < {7, 8, 9} and len(set(small)) == 3
    big = select_documents(item, 10, 20, rng)  # own + all "more" + 6 others
    assert big[:4] == [3, 7, 8, 9] and len(set(big)) == 10 and not set(big[4:]) & {3, 7, 8, 9}
    assert sorted(select_documents(item, 25, 20, rng)) == list(range(20))
    with pytest.raises(ValueError, match="smaller than the 2 own documents"):
        select_documents(QAItem(1, "q1", "q?", ["a"], [1, 2], [1]), 1, 20, rng)


def test_resumable_shards_after_interruption(tmp_path: Path):
    schema = hotpotqa_synth.PROCESS_SCHEMA
    calls: list[tuple[int, int]] = []

    def rows(start: int, end: int, fail_at: int | None = None):
        calls.append((start, end))
        if start == fail_at:
            raise KeyboardInterrupt
        return [
            qa_row("hotpotqa", f"q{k}", "ctx", ["a"], {"index": k, "num_docs": 1, "gold_docs": [1]})
            for k in range(start, end)
        ]

    out = tmp_path / "x.parquet"
    with pytest.raises(KeyboardInterrupt):
        write_sharded_parquet(out, 10, lambda s, e: rows(s, e, fail_at=6), schema, {"p": 1}, shard_size=3)
    assert calls == [(0, 3), (3, 6), (6, 9)] and not out.exists()
    calls.clear()
    write_sharded_parquet(out, 10, rows, schema, {"p": 1}, shard_size=3)
    assert calls == [(6, 9), (9, 10)]  # finished shards were not rebuilt
    assert [e["index"] for e in pd.read_parquet(out)["extra_info"]] == list(range(10))
    with pytest.raises(KeyboardInterrupt):
        write_sharded_parquet(tmp_path / "y.parquet", 4, lambda s, e: rows(s, e, fail_at=2), schema, {"p": 1}, 2)
    with pytest.raises(ValueError, match="--force"):
        write_sharded_parquet(tmp_path / "y.parquet", 4, rows, schema, {"p": 2}, 2)


# --------------------------------------------------------------------------------------------------
# Malformed input
# --------------------------------------------------------------------------------------------------


def _hotpot_row(**overrides) -> dict:
    row = {
        "_id": "x1",
        "question": "Who?",
        "answer": "Ada",
        "supporting_facts": [["T", 0]],
        "context": [["T", ["Ada wrote it."]], ["U", ["Other text."]]],
    }
    row.update(overrides)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize(
    "bad, field",
    [
        (_hotpot_row(context=None), "'context' is missing"),
        (_hotpot_row(answer=42), "'answer' must be a string"),
        (_hotpot_row(question="   "), "'question' is empty"),
        (_hotpot_row(context=[["T", "not a list"]]), "'context[0]'"),
    ],
)
def test_malformed_hotpotqa_rows_name_file_row_field(tmp_path: Path, bad: dict, field: str):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_hotpot_row(), bad]))
    with pytest.raises(DataFormatError) as err:
        read_hotpotqa(path)
    msg = str(err.value)
    assert str(path) in msg and "row 1" in msg and "_id='x1'" in msg and field in msg
    assert len(read_hotpotqa(path, skip_malformed=True).items) == 1
    with pytest.raises(DataFormatError, match="row 1"):
        hotpotqa_synth.main(["--dev", str(path), "--out", str(tmp_path / "o"), "--stages", "process"])


def test_skipped_rows_keep_their_paragraphs_in_the_pool(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_hotpot_row(), _hotpot_row(answer=["Ada"], context=[["V", ["Only here."]]])]))
    src = read_hotpotqa(path, skip_malformed=True)
    assert len(src.items) == 1  # pool indices match a pool built from the whole file
    assert src.docs == ["T\nAda wrote it.", "U\nOther text.", "V\nOnly here."]


def test_malformed_squad_entries_name_file_entry_field(tmp_path: Path):
    data = json.loads(SQUAD.read_text())
    data["data"][1]["paragraphs"][2]["qas"][0]["answers"][0]["text"] = 1694
    path = tmp_path / "squad_bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataFormatError) as err:
        read_squad(path)
    assert str(path) in str(err.value) and "data[1].paragraphs[2].qas[0]" in str(err.value)
    assert "'answers[0].text' must be a string" in str(err.value)
    data = json.loads(SQUAD.read_text())
    del data["data"][0]["paragraphs"][1]["context"]
    data["data"][2]["paragraphs"][0]["qas"][1]["question"] = ""
    path.write_text(json.dumps(data))
    with pytest.raises(DataFormatError, match=r"data\[0\]\.paragraphs\[1\]: field 'context' is missing"):
        read_squad(path)
    kept = read_squad(path, skip_malformed=True)
    assert len(kept.items) == 48 - 2 - 1  # paragraph (2 answerable) + one empty question dropped


def test_squad_reader_keeps_answerable_questions_and_article_paragraphs():
    src = read_squad(SQUAD)
    assert len(src.items) == 48 and len(src.docs) == 24  # 6 articles x 4 paragraphs x 2 answerable
    item = src.items[1]
    assert item.question.startswith("Who governed") and len(item.answers) == 2
    assert all(a in src.docs[item.doc_ids[0]] for a in item.answers)
    assert len(item.more_doc_ids) == 3 and item.doc_ids[0] not in item.more_doc_ids


# --------------------------------------------------------------------------------------------------
# Answerability filter against a scripted OpenAI-compatible server
# --------------------------------------------------------------------------------------------------


class ScriptedServer:
    """Chat completions keyed by question number k (from "Question k?"): see ``answer``."""

    def __init__(self, golds: dict[str, str]):
        self.golds = golds
        self.requests: list[dict] = []
        self.failed_once: set[str] = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": "auto-model", "object": "model", "created": 0, "owned_by": "test"}],
                    },
                )

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                status, texts = server.answer(body)
                if status != 200:
                    self._send(status, {"error": {"message": "try again", "type": "server_error"}})
                    return
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": t}}
                            for i, t in enumerate(texts)
                        ],
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> tuple[int, list[str]]:
        prompt = body["messages"][0]["content"]
        question = prompt.split("\n")[0]
        k = int(question.split()[1].rstrip("?"))
        gold = self.golds[question]
        if k == 5 and question not in self.failed_once:  # one transient server error
            self.failed_once.add(question)
            return 500, []
        base = body["model"] == "base-model"
        if base and k % 4 == 0:
            return 200, [f"Sure. \\boxed{{{gold}}}", "\\boxed{nope}"]
        if not base and k % 4 == 1:
            return 200, ["\\boxed{nope}", f"I believe it is {gold.upper()}, final \\boxed{{x}}"]
        if not base and k % 4 == 2:
            return 200, [f"\\boxed{{ {gold.lower()} }}", "\\boxed{nope}"]
        return 200, ["\\boxed{nope}", "no idea"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_filter_answerable_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    golds = {f"Question {k}?": f"Gold Answer {k}" for k in range(16)}
    rows = [
        qa_row("hotpotqa", q, f"context {k}", [g], {"index": k, "num_docs": 1, "gold_docs": [1]})
        for k, (q, g) in enumerate(golds.items())
    ]
    inp = tmp_path / "hotpotqa_dev_process.parquet"
    pd.DataFrame(rows).to_parquet(inp)
    server = ScriptedServer(golds)
    try:
        args = [
            "--input",
            str(inp),
            "--out",
            str(tmp_path / "hotpotqa_dev.parquet"),
            "--endpoint",
            f"pretrain={server.url}",
            "--endpoint",
            f"instruct={server.url}",
            "--model",
            "pretrain=base-model",
            "--model",
            "instruct=inst-model",
            "--keep",
            "3",
            "--concurrency",
            "4",
            "--retry-base-delay",
            "0.01",
        ]
        assert filter_answerable.main(args) == 0
        first_run_requests = len(server.requests)
        assert first_run_requests == 16 * 2 + 1  # one retry after the 500
        body = server.requests[0]
        assert body["n"] == 2 and body["temperature"] == 1.0 and body["top_p"] == 0.7 and body["max_tokens"] == 512
        assert body["messages"][0]["content"].endswith("?\nYour final answer in \\boxed{}.\n")

        result = pd.read_parquet(tmp_path / "hotpotqa_dev_result.parquet")
        assert len(result) == 16
        assert result["answerable"].tolist() == [k % 4 != 3 for k in range(16)]
        r0, r1, r2 = result.iloc[0], result.iloc[1], result.iloc[2]
        assert list(r0["score_boxed_pretrain"]) == [1.0, 0.0] and list(r0["score_contains_pretrain"]) == [1.0, 0.0]
        assert list(r1["score_boxed_instruct"]) == [0.0, 0.0] and list(r1["score_contains_instruct"]) == [0.0, 1.0]
        assert list(r2["score_boxed_instruct"]) == [1.0, 0.0]  # strict match ignores case and spaces
        assert len(r0["responses_instruct"]) == 2

        kept = pd.read_parquet(tmp_path / "hotpotqa_dev.parquet")
        assert [e["index"] for e in kept["extra_info"]] == [3, 7, 11]  # first 3 survivors, input order
        assert list(kept.columns[:6]) == ["data_source", "prompt", "context", "ability", "reward_model", "extra_info"]

        assert filter_answerable.main(args) == 0  # resume: everything is cached
        assert len(server.requests) == first_run_requests
        cache_file = tmp_path / "hotpotqa_dev_result.parquet.cache.jsonl"
        questions = list(golds)
        assert len(filter_answerable.load_cache(cache_file, questions)) == 32
        assert len(filter_answerable.load_cache(cache_file, ["Changed?"] + questions[1:])) == 30  # stale row 0
        assert filter_answerable.main([*args, "--no-resume"]) == 0
        assert len(server.requests) == 2 * first_run_requests - 1  # the 500 happens only once
    finally:
        server.close()


def test_filter_model_autodetect_and_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    golds = {"Question 3?": "x"}
    inp = tmp_path / "in.parquet"
    pd.DataFrame([qa_row("hotpotqa", "Question 3?", "c", ["x"], {"index": 0})]).to_parquet(inp)
    server = ScriptedServer(golds)
    try:
        assert (
            filter_answerable.main(
                ["--input", str(inp), "--out", str(tmp_path / "o.parquet"), "--endpoint", f"a={server.url}"]
            )
            == 0
        )
        assert server.requests[0]["model"] == "auto-model"
        assert (tmp_path / "o_result.parquet").exists()
    finally:
        server.close()
    # a dead endpoint: connection errors are retried, then the run reports failure
    rc = filter_answerable.main(
        [
            "--input",
            str(inp),
            "--out",
            str(tmp_path / "p.parquet"),
            "--endpoint",
            "a=http://127.0.0.1:9/v1",
            "--model",
            "a=m",
            "--max-retries",
            "1",
            "--retry-base-delay",
            "0.01",
        ]
    )
    assert rc == 1 and not (tmp_path / "p.parquet").exists()


def test_filter_rejects_malformed_parquet_rows(tmp_path: Path):
    rows = [
        qa_row("hotpotqa", "Question 1?", "c", ["x"], {"index": 0}),
        qa_row("hotpotqa", " ", "c", ["x"], {"index": 1}),
    ]
    path = tmp_path / "bad.parquet"
    pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(DataFormatError, match=r"bad\.parquet: row 1: field 'prompt\[0\]\.content'"):
        filter_answerable.read_questions(path)
    rows[1] = qa_row("hotpotqa", "Question 2?", "c", [], {"index": 1})
    pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(DataFormatError, match=r"row 1: field 'reward_model\.ground_truth'"):
        filter_answerable.read_questions(path)


# --------------------------------------------------------------------------------------------------
# RULER tasks
# --------------------------------------------------------------------------------------------------

RULER_LENGTH = 3000


@pytest.fixture(scope="module")
def ruler_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("ruler")
    assert (
        ruler_cli.main(
            [
                "--tasks",
                "all",
                "--lengths",
                str(RULER_LENGTH),
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                str(out),
                "--num-samples",
                "3",
                "--squad",
                str(SQUAD),
                "--hotpotqa",
                str(DEV),
            ]
        )
        == 0
    )
    return out


@pytest.mark.parametrize("task", sorted(TASKS))
def test_ruler_lengths_and_answerability(ruler_dir: Path, tokenizer, task: str):
    records = json.loads((ruler_dir / f"eval_{task}_{RULER_LENGTH}.json").read_text())
    assert [r["index"] for r in records] == [0, 1, 2]
    generator = TASKS[task][0]
    ttg = TOKENS_TO_GENERATE[generator]
    for r in records:
        assert {"index", "input", "context", "outputs", "answer_prefix", "length"} <= set(r)
        measured = n_tokens(tokenizer, r["input"]) + n_tokens(tokenizer, r["context"]) + ttg
        assert r["length"] == measured <= RULER_LENGTH
        if generator == "qa" and task == "qa_1":  # the 24-paragraph SQuAD fixture cannot fill 3000 tokens
            assert r["num_docs"] == 24
        else:
            assert measured >= RULER_LENGTH * 0.96, (task, measured)
        assert r["outputs"] and all(o in r["context"] for o in r["outputs"])  # answerable from the haystack
        assert r["context"] not in r["input"] and "{" not in r["input"]
        if generator == "qa":
            docs = split_documents(r["context"])
            assert len(docs) == r["num_docs"] and r["gold_docs"]
            assert any(r["outputs"][0] in docs[p - 1] for p in r["gold_docs"])
    if task == "niah_single_2":
        assert records[0]["input"].startswith("A special magic number is hidden")
        assert "What is the special magic number for" in records[0]["input"]
    if task == "niah_multiquery":
        assert records[0]["input"].count(", ") == 3 and ", and " in records[0]["input"]
        assert len(records[0]["outputs"]) == 4
    if task == "niah_multivalue":
        assert all(len(r["outputs"]) == 4 for r in records)
    if task == "vt":
        assert all(len(r["outputs"]) == 5 and f"VAR {r['outputs'][0]} = " in r["context"] for r in records)
    if task == "niah_multikey_2":  # distractor needles never use the queried key
        key = re.search(r"number for (\S+) mentioned", records[0]["input"]).group(1)
        assert records[0]["context"].count(f"for {key} is:") == 1


def test_ruler_deterministic_across_runs_and_workers(ruler_dir: Path, tokenizer_dir: Path, tmp_path: Path):
    tasks = "niah_multikey_1,niah_multikey_3,vt,fwe,qa_2"
    assert (
        ruler_cli.main(
            [
                "--tasks",
                tasks,
                "--lengths",
                str(RULER_LENGTH),
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                str(tmp_path),
                "--num-samples",
                "3",
                "--hotpotqa",
                str(DEV),
                "--workers",
                "2",
            ]
        )
        == 0
    )
    for task in tasks.split(","):
        name = f"eval_{task}_{RULER_LENGTH}.json"
        assert (tmp_path / name).read_bytes() == (ruler_dir / name).read_bytes()
    assert (
        ruler_cli.main(
            [
                "--tasks",
                "vt",
                "--lengths",
                str(RULER_LENGTH),
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                str(tmp_path / "s"),
                "--num-samples",
                "3",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    other = json.loads((tmp_path / "s" / f"eval_vt_{RULER_LENGTH}.json").read_text())
    assert other[0]["outputs"] != json.loads((ruler_dir / f"eval_vt_{RULER_LENGTH}.json").read_text())[0]["outputs"]


def test_ruler_user_haystack_and_cli_errors(tokenizer_dir: Path, tmp_path: Path):
    text = tmp_path / "hay.txt"
    text.write_text("Zebras graze quietly near the river. " * 400)
    assert (
        ruler_cli.main(
            [
                "--tasks",
                "niah_single_2",
                "--lengths",
                "1500",
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                str(tmp_path),
                "--num-samples",
                "1",
                "--haystack-files",
                str(text),
            ]
        )
        == 0
    )
    rec = json.loads((tmp_path / "eval_niah_single_2_1500.json").read_text())[0]
    key = re.search(r"number for (\S+) mentioned", rec["input"]).group(1)
    assert set(rec["context"].replace(". ", ".\n").split("\n")) == {
        "Zebras graze quietly near the river.",
        f"One of the special magic numbers for {key} is: {rec['outputs'][0]}.",
    }
    with pytest.raises(SystemExit, match="unknown task"):
        ruler_cli.main(["--tasks", "niah_x", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--squad"):
        ruler_cli.main(["--tasks", "qa_1", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path)])


# --------------------------------------------------------------------------------------------------
# Token counting and size search
# --------------------------------------------------------------------------------------------------


def test_token_counter_segments_long_text_exactly(tokenizer):
    text = " ".join(f"Sentence number {k} talks about startups and essays." for k in range(3000))
    counter = TokenCounter(tokenizer, segment_chars=5000)
    seen: list[int] = []
    original = counter._count_pieces
    counter._count_pieces = lambda pieces: (seen.extend(map(len, pieces)), original(pieces))[1]
    assert counter.count(text) == n_tokens(tokenizer, text)
    assert len(seen) > 30 and max(seen) < 5100  # never the whole text at once


def test_fit_largest_by_hand():
    assert fit_largest(lambda n: 10 + 7 * n, 100, n_guess=1) == (12, 94)  # 10 + 7*13 = 101 > 100
    assert fit_largest(lambda n: 10 + 7 * n, 100, n_guess=50) == (12, 94)
    assert fit_largest(lambda n: 10 + 7 * n, 100, n_guess=1, n_max=5) == (5, 45)
    n, t = fit_largest(lambda n: 10 + 7 * n, 100, n_guess=1, tolerance=20)
    assert 100 - t <= 20 and t <= 100
    with pytest.raises(ValueError, match="smallest size"):
        fit_largest(lambda n: 200 + n, 100, n_guess=3)


# --------------------------------------------------------------------------------------------------
# Synthetic needle QA (CPU demo / miniature reproduction)
# --------------------------------------------------------------------------------------------------


def test_make_needle_qa_dataset(tokenizer, tmp_path: Path):
    rows = make_needle_qa_dataset(12, (1, 3), 200, tokenizer, seed=3)
    kinds = ["niah_single", "niah_multikey", "variable_tracking", "multidoc_qa"]
    assert [r["extra_info"]["kind"] for r in rows] == kinds * 3
    assert {r["extra_info"]["num_chunks"] for r in rows} == {1, 2, 3}
    for i, r in enumerate(rows):
        info = r["extra_info"]
        tokens = n_tokens(tokenizer, r["context"])
        assert tokens == info["context_tokens"]
        assert (info["num_chunks"] - 1) * 200 < tokens <= info["num_chunks"] * 200
        (answer,) = r["reward_model"]["ground_truth"]
        assert re.fullmatch(r"\d{3,4}|[a-z]+|[A-Z][a-z]+", answer), answer
        assert answer in r["context"] and r["data_source"] == "synthetic_qa" and info["index"] == i
        assert r["prompt"] == [{"role": "user", "content": info["question"]}] and r["context"] not in info["question"]
    multidoc = rows[3]
    assert split_documents(multidoc["context"]) and multidoc["prompt"][0]["content"].split()[-1].endswith("?")
    vt = rows[2]
    last = vt["prompt"][0]["content"].split()[-1].rstrip("?")
    assert f"VAR {last} = VAR " in vt["context"]
    assert rows == make_needle_qa_dataset(12, (1, 3), 200, tokenizer, seed=3)
    assert rows[0]["context"] != make_needle_qa_dataset(1, (1, 3), 200, tokenizer, seed=4)[0]["context"]
    path = tmp_path / "s.parquet"
    write_parquet(rows, path, SYNTHETIC_SCHEMA)
    back = pd.read_parquet(path)
    assert len(back) == 12 and back["extra_info"][5]["kind"] == "niah_multikey"
    with pytest.raises(ValueError, match="unknown synthetic QA kind"):
        make_needle_qa_dataset(1, (1, 1), 200, tokenizer, kinds=("nope",))


def test_synthetic_qa_cli(tokenizer_dir: Path, tmp_path: Path):
    out = tmp_path / "syn.parquet"
    assert (
        synthetic_qa.main(
            [
                "--n",
                "3",
                "--num-chunks",
                "2,2",
                "--chunk-tokens",
                "150",
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                str(out),
                "--kinds",
                "multidoc_qa,niah_single",
            ]
        )
        == 0
    )
    df = pd.read_parquet(out)
    assert [e["kind"] for e in df["extra_info"]] == ["multidoc_qa", "niah_single", "multidoc_qa"]
    assert all(150 < e["context_tokens"] <= 300 for e in df["extra_info"])
