"""The format warm-up builder (recipe/miniature/warmup_data.py): which trajectories it keeps, how it rewrites the
final answer, that only the final turn is trained (checked token by token through the SFT dataset), that it
refuses held-out data, and the rollout command on the tiny model (HF engine, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from recipe.miniature import make_data
from recipe.miniature.warmup_data import (
    NotTrainingData,
    build_warmup,
    check_training_file,
    contains_gold,
    main,
    record_split,
    warmup_row,
)
from recurrent.prompts import render_final_prompt
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

Q = "Which city does Mara Tobin live in?"


def _record(i: int, response: str, answers=("Velmora",), **extra) -> dict:
    record = {"_id": i, "task": "train", "length": "all", "label": "untrained-memory-s0", "method": "recurrent-boxed",
              "status": "ok", "question": Q, "answers": list(answers), "response": response, "num_chunks": 2,
              "memory": f"memory {i}", "final_prompt": render_final_prompt(Q, f"memory {i}")}  # fmt: skip
    record.update(extra)
    return record


def _write_cell(root: Path, records: list[dict], data_file: str | None = "runs/m/data/train.parquet") -> Path:
    cell = root / "train_all"
    cell.mkdir(parents=True, exist_ok=True)
    (cell / "untrained-memory-s0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if data_file is not None:
        meta = {"task": "train", "length": "all", "method": "recurrent-boxed", "data_file": data_file}
        (cell / "untrained-memory-s0.meta.json").write_text(json.dumps(meta))
    return root


def test_gold_is_matched_as_a_whole_word_case_insensitively():
    assert contains_gold("She lives in velmora.", ["Velmora"]) == "Velmora"
    assert contains_gold("It is Castell.", ["Castel"]) is None  # a prefix of a longer word is no match
    assert contains_gold("Castel-on-sea", ["Castel"]) == "Castel"
    assert contains_gold("in New York City", ["Boston", "new york"]) == "new york"
    assert contains_gold("the answer is 42", ["4"]) is None
    assert contains_gold("anything", ["", "  "]) is None
    # gold answers as a record may hold them: one string (not its characters), a list with None, none at all
    assert warmup_row({**_record(0, "It is Velmora."), "answers": "Velmora"})[1] == "kept"
    assert warmup_row({**_record(0, "It is V."), "answers": "Velmora"})[1] == "no_gold"
    assert warmup_row({**_record(0, "It is Velmora."), "answers": [None, "Velmora"]})[1] == "kept"
    assert warmup_row({**_record(0, "It is Velmora."), "answers": None})[1] == "no_gold"


def test_keeps_only_final_answers_with_the_gold_and_boxes_the_gold(tmp_path):
    records = [
        _record(0, "The city is Velmora."),
        _record(1, "It is Castell", answers=["Castel"]),
        _record(2, "", status="error"),
        _record(3, "velmora", final_prompt=None, memory="what I kept"),  # prompt rendered from the memory
        _record(4, "Velmora", method="boxed"),  # the direct baseline: not the memory agent's final turn
        _record(5, "\\boxed{Paris}, or Velmora"),  # already boxed (something else): left out
        _record(6, "Not sure."),
    ]
    out = tmp_path / "warmup.parquet"
    counts = build_warmup([_write_cell(tmp_path / "rec", records)], out)
    assert counts == {"kept": 2, "no_gold": 2, "not_ok": 1, "other_method": 1, "already_boxed": 1}
    df = pd.read_parquet(out)
    assert df["item_id"].tolist() == [0, 3] and set(df["split"]) == {"train"}
    conv0 = [dict(m) for m in df["messages"][0]]
    assert conv0 == [
        {"role": "user", "content": render_final_prompt(Q, "memory 0")},
        {"role": "assistant", "content": "The city is Velmora. \\boxed{Velmora}"},
    ]
    conv3 = [dict(m) for m in df["messages"][1]]
    assert conv3[0]["content"] == render_final_prompt(Q, "what I kept")
    assert conv3[1]["content"] == "velmora \\boxed{Velmora}"  # the model's text, then the gold as given


def test_only_the_rewritten_answer_is_trained(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    out = tmp_path / "warmup.parquet"
    build_warmup([_write_cell(tmp_path / "rec", [_record(0, "The city is Velmora.")])], out)
    row = MultiTurnSFTDataset(str(out), tok, {"max_length": 4096})[0]
    ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
    answer = tok("The city is Velmora. \\boxed{Velmora}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert sum(mask) == len(answer)
    start = mask.index(1)
    assert ids[start : start + len(answer)] == answer and all(mask[start : start + len(answer)])
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": render_final_prompt(Q, "memory 0")}], tokenize=False, add_generation_prompt=True
    )
    assert ids[:start] == tok(prompt, add_special_tokens=False)["input_ids"]  # the prompt, as the model saw it


@pytest.mark.parametrize(
    "name", ["val.parquet", "eval_niah_single_8.parquet", "test-2.jsonl", "hotpotqa_dev.parquet", "validation.json"]
)
def test_held_out_file_names_are_refused(name, tmp_path):
    with pytest.raises(NotTrainingData, match="held-out"):
        check_training_file(f"data/{name}")
    with pytest.raises(NotTrainingData, match="held-out"):
        build_warmup([_write_cell(tmp_path / "rec", [_record(0, "Velmora")], data_file=f"data/{name}")], tmp_path / "o")
    assert not (tmp_path / "o").exists()
    check_training_file("data/train.parquet")
    check_training_file("data/retrieval_train_8.parquet")  # "retrieval" contains "eval" but is not the word


def test_records_must_show_they_come_from_training_data(tmp_path):
    assert record_split({"split": "train"}, None) == "train"
    assert record_split({}, {"data_file": "d/train.parquet"}) == "train"
    assert record_split({}, {"data_file": "d/training-set.jsonl"}) == "train"
    with pytest.raises(NotTrainingData, match="split='test'"):
        record_split({"_id": 3, "split": "test"}, {"data_file": "d/train.parquet"})
    with pytest.raises(NotTrainingData, match="split='validation'"):
        record_split({"extra_info": {"split": "validation"}}, None)
    with pytest.raises(NotTrainingData, match="neither a split field nor a training data file"):
        record_split({"_id": 1}, None)
    with pytest.raises(NotTrainingData, match="neither"):
        record_split({}, {"data_file": "d/questions.parquet"})
    rec = _write_cell(tmp_path / "rec", [_record(0, "Velmora", split="test")])
    assert main(["build", "--records", str(rec), "--out", str(tmp_path / "o.parquet")]) == 2
    assert main(["rollouts", "--data", "d/val.parquet", "--model", "m", "--out", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "r").exists()


def test_rollouts_on_the_training_file_record_the_final_prompt(tiny_model_path, tmp_path):
    args = make_data.build_parser().parse_args(
        [
            "--tokenizer",
            str(tiny_model_path),
            "--out",
            str(tmp_path / "data"),
            "--chunk-tokens",
            "128",
            "--train-n",
            "2",
            "--val-n",
            "1",
            "--train-max-chunks",
            "2",
            "--only-train",
        ]  # fmt: skip
    )
    make_data.write_files(make_data.plan_files(args)[:1], str(tiny_model_path), 128, workers=1)
    train = tmp_path / "data" / "train.parquet"
    code = main(["rollouts", "--data", str(train), "--model", str(tiny_model_path), "--out", str(tmp_path / "r"),
                 "--engine", "hf", "--dtype", "float32", "--chunk-tokens", "128", "--max-memory-tokens", "8",
                 "--max-final-tokens", "8"])  # fmt: skip
    assert code == 0
    records = [json.loads(x) for x in (tmp_path / "r" / "train_all" / "untrained-memory-s0.jsonl").open()]
    assert len(records) == 2 and {r["status"] for r in records} == {"ok"}
    for r in records:
        assert r["final_prompt"] == render_final_prompt(r["question"], r["memory"])
    meta = json.loads((tmp_path / "r" / "train_all" / "untrained-memory-s0.meta.json").read_text())
    assert meta["data_file"] == str(train)
    # the random model never says the gold: nothing to keep, and the builder says why
    hits = sum(contains_gold(r["response"], r["answers"]) is not None for r in records)
    if hits == 0:
        with pytest.raises(ValueError, match="no record kept.*'no_gold': 2"):
            build_warmup([tmp_path / "r"], tmp_path / "w.parquet")
    else:
        assert build_warmup([tmp_path / "r"], tmp_path / "w.parquet")["kept"] == hits
