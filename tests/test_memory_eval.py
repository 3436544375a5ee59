"""Evaluation harness without a real model: prompts, chunking, data validation, scoring, retries,
resume and the summary, against a scripted loopback OpenAI server that fails on purpose."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recurrent.prompts import (
    MEMORY_FINAL_TEMPLATE_ANSWER_IS,
    MEMORY_FINAL_TEMPLATE_BOXED,
    MEMORY_UPDATE_TEMPLATE,
    NO_MEMORY,
    render_final_prompt,
    render_update_prompt,
)
from serve.vllm_server import ServerSpec, build_launch_plans, wait_for_health
from taskutils.memory_eval import run as eval_run
from taskutils.memory_eval.chunking import HFTokenizer, count_tokens, iter_chunks, load_tokenizer, middle_truncate
from taskutils.memory_eval.client import (
    RequestFailed,
    RequestStats,
    RetryPolicy,
    chat_completion,
    endpoint_from_env,
    make_client,
)
from taskutils.memory_eval.data import EvalDataError, load_eval_items
from taskutils.memory_eval.results import read_records
from taskutils.memory_eval.scoring import score_response
from taskutils.memory_eval.summary import collect_rows, length_label
from taskutils.memory_eval.testing import ScriptedOpenAIServer, question_of_prompt

# --------------------------------------------------------------------------------------------
# prompts (docs/spec.md#prompts)

SPEC_UPDATE = (
    "You are presented with a problem, a section of an article that may contain the answer to the problem, and a "
    "previous memory. Please read the provided section carefully and update the memory with the new information that "
    "helps to answer the problem. Be sure to retain all relevant details from the previous memory while adding any new, "
    "useful information.\n\n<problem> \n{prompt}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\n<section>\n{chunk}\n"
    "</section>\n\nUpdated memory:\n"
)
SPEC_FINAL_BOXED = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous memory "
    "and put the answer in \\boxed{}.\n\n<problem> \n{prompt}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\n"
    "Your answer:\n"
)
SPEC_FINAL_ANSWER_IS = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous memory "
    'and format your response as follows "Therefore, the answer is (insert answer here)".\n\n<problem> \n{prompt}\n'
    "</problem>\n\n<memory>\n{memory}\n</memory>\n\nYour answer:\n"
)


def test_prompt_templates_are_the_exact_spec_texts():
    assert MEMORY_UPDATE_TEMPLATE == SPEC_UPDATE
    assert MEMORY_FINAL_TEMPLATE_BOXED == SPEC_FINAL_BOXED
    assert MEMORY_FINAL_TEMPLATE_ANSWER_IS == SPEC_FINAL_ANSWER_IS
    assert NO_MEMORY == "No previous memory"
    rendered = render_final_prompt("Q?", "M", style="boxed")
    assert "put the answer in \\boxed{}." in rendered and "{{}}" not in rendered  # docs/spec.md#bug-boxed-braces


def test_render_prompts_with_braces_and_placeholder_like_values():
    question = "What is {x} in f(x) = {memory}?"
    memory = "saw {chunk} and \\boxed{2}"
    chunk = 'json {"a": {"b": 1}} {prompt}'
    got = render_update_prompt(question, memory, chunk)
    expected = SPEC_UPDATE.split("{prompt}")[0] + question + "\n</problem>\n\n<memory>\n" + memory
    expected += "\n</memory>\n\n<section>\n" + chunk + "\n</section>\n\nUpdated memory:\n"
    assert got == expected
    assert render_update_prompt("q", None, "c").count(NO_MEMORY) == 1
    assert render_final_prompt("q", "", style="answer_is").endswith(
        f"<memory>\n{NO_MEMORY}\n</memory>\n\nYour answer:\n"
    )
    with pytest.raises(ValueError, match="unknown final prompt style 'box'"):
        render_final_prompt("q", "m", style="box")


# --------------------------------------------------------------------------------------------
# chunking


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path) -> HFTokenizer:
    return load_tokenizer(tiny_model_path)


def _essay_text(n_chars: int) -> str:
    words = "the memory agent reads a long document in chunks and overwrites its memory after each one".split()
    sentence = " ".join(w + ("." if i % 17 == 16 else "") for i, w in enumerate(words * 17))
    return (sentence + " ") * (n_chars // (len(sentence) + 1) + 1)


def test_token_chunks_match_whole_text_tokenization(tokenizer):
    text = _essay_text(30_000) + "\n\nDocument 2:\nUnicode: café – naïve – 東京 {braces}"
    offsets = tokenizer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    n_tokens, chunk = len(offsets), 300
    # small windows force many window seams
    chunks = list(iter_chunks(text, chunk, tokenizer, window_chars=chunk * 6))
    assert "".join(chunks) == text
    assert len(chunks) == -(-n_tokens // chunk)
    position = 0
    for j, piece in enumerate(chunks):
        if j:
            assert position == offsets[j * chunk][0], f"chunk {j} starts at {position}"
        position += len(piece)
    assert count_tokens(text, tokenizer) == n_tokens


def test_char_chunks_cut_at_whitespace_by_hand():
    text = "aaaa bbbb cccc dddd eeee"  # 24 chars; 2 tokens x 5 chars = 10-char windows, slack 1
    assert list(iter_chunks(text, 2, None, chars_per_token=5.0)) == ["aaaa bbbb ", "cccc dddd ", "eeee"]
    long_word = "x" * 25
    assert list(iter_chunks(long_word, 2, None, chars_per_token=5.0)) == ["x" * 10, "x" * 10, "x" * 5]
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        list(iter_chunks(text, 0))


def test_chunking_is_lazy_and_window_bounded(tokenizer):
    calls: list[int] = []

    class Spy:
        def token_starts(self, text: str) -> list[int]:
            calls.append(len(text))
            return tokenizer.token_starts(text)

    text = _essay_text(1_000_000)
    gen = iter_chunks(text, 500, Spy(), window_chars=8_000)
    first = next(gen)
    assert len(calls) == 1 and calls[0] <= 8_000  # only the first window was tokenized
    assert text.startswith(first)
    rest = list(gen)
    assert max(calls) <= 8_000 and len(calls) > 100
    assert len("".join([first] + rest)) == len(text)


def test_middle_truncate_keeps_head_and_tail():
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    out, before, after = middle_truncate(text, 10, None, chars_per_token=1.0)
    assert (out, before, after) == (text[:5] + text[-5:], 100, 10)
    same, before, after = middle_truncate(text, 1000, None, chars_per_token=1.0)
    assert same == text and before == after == 100


def test_middle_truncate_with_tokenizer(tokenizer):
    text = "HEAD " + _essay_text(20_000) + " TAIL"
    out, before, after = middle_truncate(text, 400, tokenizer)
    n = len(tokenizer.token_starts(out))
    assert before > 2000 and after == 400 and abs(n - 400) <= 2
    assert out.startswith("HEAD ") and out.endswith(" TAIL")


def test_middle_truncate_cuts_where_whole_text_tokenization_does_in_one_pass(tokenizer):
    text = "HEAD " + _essay_text(120_000) + " TAIL"  # several 4,096-token spans
    offsets = tokenizer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    total, keep = len(offsets), 1000
    seen: list[int] = []

    class Spy:
        def token_starts(self, piece: str) -> list[int]:
            seen.append(len(piece))
            return tokenizer.token_starts(piece)

    out, before, after = middle_truncate(text, keep, Spy())
    assert (before, after) == (total, keep)
    assert out == text[: offsets[keep // 2][0]] + text[offsets[total - keep // 2][0] :]
    # one streamed pass over the text plus the two spans holding the cuts (not a pass per cut)
    assert sum(seen) < 1.5 * len(text)


# --------------------------------------------------------------------------------------------
# data files


def _write(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def test_load_formats(tmp_path):
    rows = [{"context": "Document 1:\nx", "input": " Who? ", "answers": ["A"], "num_docs": 1, "index": 7}]
    items, invalid = load_eval_items(_write(tmp_path / "eval_1.json", rows))
    assert invalid == [] and items[0].question == "Who?" and items[0].answers == ["A"]
    assert items[0].meta["index"] == 7 and "context" not in items[0].meta
    (tmp_path / "r.jsonl").write_text(
        json.dumps({"context": ["d1", "d2"], "input": "q", "outputs": ["x", "y"]}) + "\n", encoding="utf-8"
    )
    items, _ = load_eval_items(tmp_path / "r.jsonl")
    assert items[0].get_context() == "Document 1:\nd1\n\nDocument 2:\nd2" and items[0].answers == ["x", "y"]
    pool = ["doc zero", "doc one"]
    _write(tmp_path / "idx.json", [{"context": [1, 0], "input": "q", "answers": "z"}])
    items, _ = load_eval_items(tmp_path / "idx.json", doc_pool=pool)
    assert items[0].get_context() == "Document 1:\ndoc one\n\nDocument 2:\ndoc zero" and items[0].answers == ["z"]
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame(
        [{"prompt": [{"role": "user", "content": "Where?"}], "context": "ctx",
          "reward_model": {"style": "rule", "ground_truth": np.array(["Here"])}}]
    )  # fmt: skip
    frame.to_parquet(tmp_path / "dev.parquet")
    items, _ = load_eval_items(tmp_path / "dev.parquet")
    assert (items[0].question, items[0].context, items[0].answers) == ("Where?", "ctx", ["Here"])


@pytest.mark.parametrize(
    "row, needles",
    [
        ({"input": "q", "answers": ["a"]}, ["row 1", "missing context"]),
        ({"input": "q", "context": "c", "answers": ["a", 5]}, ["row 1", "field 'answers'", "answer #1 is int"]),
        ({"input": "q", "context": "c", "answers": 1945}, ["row 1", "field 'answers'", "int"]),
        ({"input": "   ", "context": "c", "answers": ["a"]}, ["row 1", "field 'input'", "empty question"]),
        ({"input": "q", "context": [3], "answers": ["a"]}, ["row 1", "field 'context'", "--doc-pool"]),
    ],
)
def test_malformed_rows_name_file_row_field(tmp_path, row, needles):
    path = _write(tmp_path / "bad.json", [{"input": "ok", "context": "c", "answers": ["a"]}, row])
    with pytest.raises(EvalDataError) as err:
        load_eval_items(path)
    message = str(err.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message
    items, invalid = load_eval_items(path, skip_invalid=True)
    assert [i.id for i in items] == [0] and invalid[0][0] == 1


# --------------------------------------------------------------------------------------------
# scoring: lenient and strict side by side


def test_score_response_lenient_vs_strict_by_hand():
    s = score_response("\\boxed{Paris}\nTherefore, the answer is Paris.", ["Paris"], "recurrent")
    assert (s["em"], s["sub_em"], s["f1"], s["string_match_all"], s["strict_boxed"]) == (1, 1, 1, 1, 1)
    # everything after "the answer is" is the prediction: "paris boxedparis" -> em 0, sub_em 1, f1 2/3
    s = score_response("Therefore, the answer is Paris.\n\\boxed{Paris}", ["Paris"], "recurrent")
    assert (s["em"], s["sub_em"], s["f1"], s["strict_boxed"]) == (0, 1, pytest.approx(2 / 3), 1)
    s = score_response("Therefore, the answer is the city of Paris", ["Paris"], "recurrent")
    # normalised pred "city of paris" (3 tokens) vs "paris": precision 1/3, recall 1 -> f1 0.5
    assert (s["em"], s["sub_em"], s["f1"], s["strict_boxed"]) == (0, 1, 0.5, 0)
    s = score_response("so \\boxed{Eiffel Tower}", ["the Eiffel Tower"], "recurrent-boxed")
    assert (s["pred"], s["em"], s["sub_em"], s["strict_boxed"]) == ("Eiffel Tower", 1, 1, 0)
    s = score_response("I think \\boxed{Rome}", ["Rome"], "recurrent")
    assert (s["pred"], s["sub_em"], s["strict_boxed"]) == (None, 0, 1)
    s = score_response("Therefore, the answer is abc and xyz", ["ABC", "xyz", "qq"], "openai")
    assert s["string_match_all"] == pytest.approx(2 / 3)
    # the lenient QA metrics take the best gold answer, not the first one (docs/spec.md#bug-first-gold-only)
    s = score_response("Therefore, the answer is Rome.", ["Paris", "Rome"], "recurrent")
    assert (s["em"], s["sub_em"], s["f1"]) == (1, 1, 1)
    # string_match_all reads the extracted prediction; in_response the whole response
    s = score_response("Paris is big. Therefore, the answer is Rome.", ["Paris"], "recurrent")
    assert (s["pred"], s["string_match_all"], s["in_response"]) == ("Rome", 0, 1)


def test_format_free_score_reads_the_whole_response():
    # no box and no "the answer is": every extracted metric is 0, the format-free one sees the answer
    s = score_response("The special magic number for grand-owl is 8942.", ["8942"], "recurrent-boxed")
    assert (s["pred"], s["string_match_all"], s["strict_boxed"], s["in_response"]) == (None, 0, 0, 1)
    s = score_response("It is 12 or maybe 7.", ["12", "8942"], "boxed")
    assert s["in_response"] == pytest.approx(1 / 2)
    assert score_response(None, ["1"], "boxed")["in_response"] == 0


# --------------------------------------------------------------------------------------------
# retries against the scripted server

FAST = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05)


def test_chat_retries_500_429_and_stall_then_succeeds():
    with ScriptedOpenAIServer(models=["m"], faults=["500", "429", "stall"], stall_seconds=8) as srv:

        async def go():
            client = make_client(endpoint_from_env(srv.base_url), timeout=1.0)
            stats = RequestStats()
            t0 = time.perf_counter()
            out = await chat_completion(client, "m", [{"role": "user", "content": "x"}], FAST, stats, max_tokens=5)
            await client.close()
            return out, stats, time.perf_counter() - t0

        (content, finish), stats, elapsed = asyncio.run(go())
    assert content == "Therefore, the answer is unknown." and finish == "stop"
    assert (stats.requests, stats.retries) == (4, 3)
    assert srv.outcomes() == ["500", "429", "stall", "ok"]
    assert elapsed < 6  # the 8 s stall was cut by the 1 s timeout, not waited out
    assert any("HTTP 500" in e for e in stats.errors) and any("HTTP 429" in e for e in stats.errors)


def test_chat_gives_up_and_does_not_retry_client_errors():
    with ScriptedOpenAIServer(models=["m"], fault_for=lambda c: "500") as srv:

        async def go(model):
            client = make_client(endpoint_from_env(srv.base_url), timeout=2)
            try:
                await chat_completion(client, model, [{"role": "user", "content": "x"}], FAST)
            finally:
                await client.close()

        with pytest.raises(RequestFailed, match=r"gave up after 4 attempts: InternalServerError: HTTP 500"):
            asyncio.run(go("m"))
        with pytest.raises(RequestFailed, match=r"non-retryable error: NotFoundError: HTTP 404"):
            asyncio.run(go("other"))
    assert srv.outcomes() == ["500"] * 4 + ["404"]


# --------------------------------------------------------------------------------------------
# the harness end to end: faults, failure records, resume, summary

GOLD = {
    "q0 capital of France?": ("Paris", "Therefore, the answer is Paris."),  # lenient 1, strict 0
    "q1 landmark?": ("the Eiffel Tower", "\\boxed{Eiffel Tower} Therefore, the answer is Eiffel Tower."),  # 1, 0
    "q2 capital of Germany?": ("Berlin", "Therefore, the answer is London."),  # 0, 0
    "q3 capital of Italy?": ("Rome", "My guess: \\boxed{Rome}"),  # 0, 1
}


def _reply(content: str) -> str:
    if "Updated memory:" in content:
        return "memory: " + content.split("<section>\n", 1)[1][:20]
    question = question_of_prompt(content) or ""
    return GOLD.get(question.replace(" ALWAYS500", ""), ("", "Therefore, the answer is nothing."))[1]


def _dataset(root: Path, docs: int, marker_row: int | None = None) -> Path:
    rows = []
    for i, (question, (gold, _)) in enumerate(GOLD.items()):
        context = "\n\n".join(f"Document {d + 1}:\nParagraph {d} about item {i}. " * 3 for d in range(docs))
        rows.append({"context": context, "input": question + (" ALWAYS500" if i == marker_row else ""), "answers": [gold],
                     "num_docs": docs, "index": i})  # fmt: skip
    return _write(root / f"eval_{docs}.json", rows)


def _run(argv: list[str]) -> int:
    return eval_run.main(argv + ["--no-progress"])


def test_harness_retries_records_failures_and_resumes(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    _dataset(data, 2)
    _dataset(data, 4, marker_row=0)
    out = tmp_path / "out"
    fail_switch = {"on": True}
    faults = ["500", "429", "stall", "500", "429", "stall", "500"]

    def fault_for(content: str) -> str | None:
        return "500" if fail_switch["on"] and "ALWAYS500" in content else None

    argv = ["--model", "m", "--methods", "recurrent", "openai", "--tasks", "hotpotqa", "--lengths", "2", "4",
            "--data-root", str(data), "--out", str(out), "--concurrency", "3", "--chunk-size", "16",
            "--max-attempts", "8", "--backoff", "0.01", "--max-backoff", "0.02", "--timeout", "1.5"]  # fmt: skip
    with ScriptedOpenAIServer(models=["m"], reply=_reply, faults=faults, fault_for=fault_for, stall_seconds=8) as srv:
        argv += ["--base-url", srv.base_url]
        assert _run(argv) == 1  # the always-500 item failed for both methods
        first = srv.outcomes()
        assert first.count("stall") == 2 and first.count("429") == 2 and not srv.faults  # all faults served
        for method in ("recurrent", "openai"):
            records = read_records(out / "hotpotqa_4" / f"m-{method}.jsonl")
            assert sorted(records) == [0, 1, 2, 3]  # every item accounted for
            failed = records[0]
            assert failed["status"] == "error" and "HTTP 500" in failed["error"] and failed["requests"] == 8
            assert all(records[i]["status"] == "ok" for i in (1, 2, 3))
        rows = {(r.label, r.length): r for r in collect_rows(out)}
        assert rows[("m-recurrent", 4)].n_failed == 1 and rows[("m-recurrent", 4)].n_ok == 3
        assert rows[("m-recurrent", 4)].scores["sub_em"] == pytest.approx(25.0)  # failed item counts as 0

        fail_switch["on"] = False  # the server recovers; the same command resumes
        n_before = len(srv.outcomes())
        assert _run(argv) == 0
        redone = srv.outcomes()[n_before:]
        assert set(redone) == {"ok"}
        recurrent_chunks = read_records(out / "hotpotqa_4" / "m-recurrent.jsonl")[0]["num_chunks"]
        assert len(redone) == (recurrent_chunks + 1) + 1  # only item 0 again: memory turns + final, and one direct call

        n_before = len(srv.outcomes())
        assert _run(argv) == 0  # nothing left to do
        assert len(srv.outcomes()) == n_before
    capsys.readouterr()

    rows = collect_rows(out)
    assert len(rows) == 4
    for row in rows:
        assert (row.n_items, row.n_ok, row.n_failed, row.n_missing) == (4, 4, 0, 0)
        assert row.scores["sub_em"] == pytest.approx(50.0) and row.scores["strict_boxed"] == pytest.approx(25.0)
        assert row.scores["em"] == pytest.approx(50.0)
    records = read_records(out / "hotpotqa_2" / "m-recurrent.jsonl")
    assert records[1]["judge_sub_em"] == 1 and records[1]["judge_strict_boxed"] == 0
    assert records[3]["judge_sub_em"] == 0 and records[3]["judge_strict_boxed"] == 1
    assert records[0]["num_chunks"] >= 2 and records[0]["index"] == 0

    markdown = (out / "summary.md").read_text()
    assert "sub_em (lenient)" in markdown and "strict_boxed (strict)" in markdown
    assert "| m-recurrent | sub_em (lenient) | 50.00 | 50.00 |" in markdown
    assert "| m-recurrent | strict_boxed (strict) | 25.00 | 25.00 |" in markdown
    with (out / "summary.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert {"em", "sub_em", "f1", "string_match_all", "strict_boxed", "n_failed", "n_missing"} <= set(table[0])
    assert (out / "accuracy_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_harness_rejects_malformed_file_before_any_request(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    path = _write(
        data / "eval_2.json", [{"input": "q", "context": "c", "answers": ["a"]}, {"input": "q", "answers": ["a"]}]
    )
    with ScriptedOpenAIServer(models=["m"]) as srv:
        rc = _run(["--model", "m", "--base-url", srv.base_url, "--tasks", "hotpotqa", "--lengths", "2",
                   "--data-root", str(data), "--out", str(tmp_path / "out")])  # fmt: skip
        assert rc == 2 and srv.outcomes() == []
        err = capsys.readouterr().err
        assert str(path) in err and "row 1" in err and "missing context" in err
        rc = _run(["--model", "m", "--base-url", srv.base_url, "--tasks", "hotpotqa", "--lengths", "2", "--skip-invalid",
                   "--data-root", str(data), "--out", str(tmp_path / "out"), "--chunk-size", "50"])  # fmt: skip
        assert rc == 1
    capsys.readouterr()
    (row,) = collect_rows(tmp_path / "out")
    assert (row.n_items, row.n_ok, row.n_invalid, row.n_missing) == (2, 1, 1, 0)


def test_summary_counts_missing_items_as_zero(tmp_path):
    cell = tmp_path / "niah_single_1_8192"
    cell.mkdir()
    (cell / "x.meta.json").write_text(json.dumps({"task": "niah_single_1", "length": 8192, "label": "x", "n_items": 4}))
    lines = [
        {"_id": 0, "status": "ok", "judge_string_match_all": 1.0, "judge_strict_boxed": 0.0},
        {"_id": 1, "status": "ok", "judge_string_match_all": 0.5, "judge_strict_boxed": 1.0},
        {"_id": 2, "status": "error", "error": "boom"},
    ]
    (cell / "x.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n{truncated")
    (row,) = collect_rows(tmp_path)
    assert (row.n_ok, row.n_failed, row.n_missing) == (2, 1, 1)
    assert row.scores["string_match_all"] == pytest.approx(37.5)  # (1 + 0.5) / 4
    assert row.scores["strict_boxed"] == pytest.approx(25.0)
    assert length_label("hotpotqa", 6400) == "896K" and length_label("niah_single_1", 524288) == "512K"


def test_summary_with_paper_table(tmp_path):
    from taskutils.memory_eval.summary import write_summary

    for docs, correct in ((50, 3), (100, 1)):
        cell = tmp_path / f"hotpotqa_{docs}"
        cell.mkdir()
        (cell / "a.meta.json").write_text(json.dumps({"task": "hotpotqa", "length": docs, "label": "a", "n_items": 4}))
        lines = [
            {"_id": i, "status": "ok", "judge_sub_em": float(i < correct), "judge_strict_boxed": 0.0} for i in range(4)
        ]
        (cell / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    paths = write_summary(tmp_path, with_paper=True)
    markdown = paths["markdown"].read_text()
    assert "| label | metric | 7K | 14K |" in markdown
    assert (
        "| a | sub_em (lenient) | 75.00 | 25.00 |" in markdown
        and "| a | strict_boxed (strict) | 0.00 | 0.00 |" in markdown
    )
    assert "| RL-MemAgent-14B | 83.59 | 82.03 |" in markdown
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_config_matrix_unknown_key_is_named(tmp_path, capsys):
    config = tmp_path / "m.json"
    config.write_text(json.dumps({"models": [{"model": "m", "agent": {"chunk_tokenz": 5}}],
                                  "tasks": [{"name": "hotpotqa", "files": {"2": str(_dataset(tmp_path, 2))}}]}))  # fmt: skip
    assert _run(["--config", str(config), "--out", str(tmp_path / "o")]) == 2
    assert "chunk_tokenz" in capsys.readouterr().err
    config.write_text(json.dumps({"models": [{"model": "m", "chunk": 5}], "tasks": []}))
    assert _run(["--config", str(config)]) == 2
    assert "models[0]" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# serve launchers (commands; readiness)


def test_launch_plans_cpu_gpu_dp_and_processes():
    cpu = build_launch_plans(ServerSpec("/m", "tiny", port=9000, device="cpu", replicas=2, max_model_len=4096))
    assert [p.port for p in cpu] == [9000, 9001]
    assert cpu[0].cmd[:4] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert "--served-model-name" in cpu[1].cmd and "9001" in cpu[1].cmd and "4096" in cpu[1].cmd
    dp = build_launch_plans(ServerSpec("/m", device="gpu", tensor_parallel_size=2, replicas=4))
    (plan,) = dp
    assert plan.cmd[plan.cmd.index("serve") + 1] == "/m"
    assert plan.cmd[plan.cmd.index("--tensor-parallel-size") + 1] == "2"
    assert plan.cmd[plan.cmd.index("--data-parallel-size") + 1] == "4"
    procs = build_launch_plans(
        ServerSpec(
            "/m", device="gpu", tensor_parallel_size=2, replicas=2, replica_mode="processes", gpu_ids=list("0123")
        )
    )
    assert [(p.port, p.env["CUDA_VISIBLE_DEVICES"]) for p in procs] == [(8000, "0,1"), (8001, "2,3")]
    with pytest.raises(ValueError, match="need 6 GPUs"):
        build_launch_plans(ServerSpec("/m", device="gpu", tensor_parallel_size=2, replicas=3,
                                      replica_mode="processes", gpu_ids=list("0123")))  # fmt: skip


def test_wait_for_health(tmp_path):
    with ScriptedOpenAIServer() as srv:
        assert wait_for_health(f"http://127.0.0.1:{srv.port}/health", timeout=5) < 5
    log = tmp_path / "server.log"
    log.write_text("line 1\nImportError: something broke\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match=r"exited with code 3[\s\S]*something broke"):
        wait_for_health("http://127.0.0.1:1/health", timeout=5, process=proc, log_path=log, interval=0.05)
    with pytest.raises(TimeoutError, match="not ready after"):
        wait_for_health("http://127.0.0.1:1/health", timeout=0.2, interval=0.05)


def test_harness_starts_and_stops_a_server_per_model(tmp_path, monkeypatch, tiny_model_path, capsys):
    """--serve-path: the server group is started, waited for, used round-robin (2 replicas) and stopped;
    the served model's path doubles as the chunking tokenizer."""
    events: list[str] = []

    class FakeGroup:  # stands in for serve.vllm_server.VLLMServerGroup (the real one is tested with vLLM)
        def __init__(self, spec, log_dir):
            self.spec = spec
            self.servers = [ScriptedOpenAIServer(models=[spec.name], reply=_reply) for _ in range(spec.replicas)]

        def start(self):
            events.append(
                f"start {self.spec.model_path} tp={self.spec.tensor_parallel_size} replicas={self.spec.replicas}"
            )
            for server in self.servers:
                server.start()
            return self

        def wait_ready(self, timeout):
            events.append("ready")
            return 0.0

        @property
        def base_urls(self):
            return [server.base_url for server in self.servers]

        def stop(self):
            events.append("stop " + ",".join(str(len(server.outcomes())) for server in self.servers))
            for server in self.servers:
                server.stop()

    monkeypatch.setattr(eval_run, "VLLMServerGroup", FakeGroup)
    data = tmp_path / "data"
    data.mkdir()
    _dataset(data, 2)
    rc = _run(["--model", "served", "--serve-path", str(tiny_model_path), "--tp", "2", "--replicas", "2",
               "--replica-mode", "processes", "--tasks", "hotpotqa", "--lengths", "2", "--data-root", str(data),
               "--out", str(tmp_path / "out"), "--chunk-size", "40"])  # fmt: skip
    capsys.readouterr()
    assert rc == 0
    assert events[:2] == [f"start {tiny_model_path} tp=2 replicas=2", "ready"] and events[2].startswith("stop ")
    per_server = [int(n) for n in events[2][len("stop ") :].split(",")]
    assert all(n > 0 for n in per_server)  # items went round-robin to both replicas
    records = read_records(tmp_path / "out" / "hotpotqa_2" / "served-recurrent.jsonl")
    text = _dataset(tmp_path, 2).read_text()
    n_tokens = len(load_tokenizer(tiny_model_path).token_starts(json.loads(text)[0]["context"].strip()))
    assert records[0]["num_chunks"] == -(-n_tokens // 40)  # token chunks of the served model's tokenizer
    assert sum(per_server) == sum(r["requests"] for r in records.values())


def test_summary_cli_names_a_missing_or_empty_results_directory(tmp_path, capsys):
    from taskutils.memory_eval.summary import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "nope")])
    assert f"--out {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert "no results there" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written
