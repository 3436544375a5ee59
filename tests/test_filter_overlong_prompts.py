"""``data.filter_overlong_prompts`` drops too-long prompts when the dataset loads and says how many, per file.

Single-turn (``RLHFDataset``): the prompt is the chat-templated messages, limited by ``data.max_prompt_length``.
Memory workflow (``MemoryDataset``): the prompt is the question (the ``prompt_ids`` every turn embeds), limited
by the question budget ``recurrent.memory.config.max_prompt_length`` (``data.max_prompt_length`` only sizes the
engine there). Kept rows keep the ``index`` / ``sample_uuid`` they have without filtering.
"""

from __future__ import annotations

import logging

import pandas as pd
import pytest
from transformers import AutoTokenizer

from recurrent.impls.memory import MemoryConfig, MemoryDataset
from verl.utils.dataset.rl_dataset import RLHFDataset


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def write_rows(path, questions: list[str]) -> str:
    rows = [
        {
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": q}],
            "context": "some context words " * 5,
            "reward_model": {"style": "rule", "ground_truth": ["42"]},
        }
        for q in questions
    ]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


SHORT, LONG = "What is the code?", "Which of these words " + " ".join(f"q{i}" for i in range(80)) + "?"


def templated_length(tok, question: str) -> int:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_single_turn_drops_prompts_over_max_prompt_length(tmp_path, tok, caplog):
    first = write_rows(tmp_path / "a.parquet", [SHORT, LONG, SHORT])
    second = write_rows(tmp_path / "b.parquet", [SHORT, SHORT])
    limit = templated_length(tok, SHORT)  # the short prompt fits exactly; the long one does not
    assert templated_length(tok, LONG) > limit
    config = {"max_prompt_length": limit, "truncation": "error"}
    unfiltered = RLHFDataset([first, second], tok, config)
    with caplog.at_level(logging.WARNING):
        filtered = RLHFDataset([first, second], tok, {**config, "filter_overlong_prompts": True})
    assert len(unfiltered) == 5 and len(filtered) == 4 and len(filtered.dataframe) == 4
    assert "dropped 1 of 3 rows of " + first in caplog.text and "data.max_prompt_length=" in caplog.text
    assert second not in caplog.text  # nothing dropped there, nothing said
    # the kept rows are the unfiltered rows 0, 2, 3, 4 with their identities, and load without a length error
    kept = [filtered[i] for i in range(4)]
    want = [unfiltered[i] for i in (0, 2, 3, 4)]
    assert [r["sample_uuid"] for r in kept] == [r["sample_uuid"] for r in want]
    assert [r["index"] for r in kept] == [0, 2, 3, 4]
    with pytest.raises(ValueError, match="data.truncation=error"):  # without the filter the long row fails
        unfiltered[1]


def test_memory_dataset_filters_on_the_question_budget(tmp_path, tok, caplog):
    path = write_rows(tmp_path / "m.parquet", [SHORT, LONG, LONG])
    long_tokens = len(tok.encode(LONG, add_special_tokens=False))
    cfg = MemoryConfig(chunk_size=16, max_chunks=4, max_prompt_length=long_tokens - 1)
    data_cfg = {"truncation": "center", "max_prompt_length": 10_000, "filter_overlong_prompts": True}
    with caplog.at_level(logging.WARNING):
        ds = MemoryDataset(cfg, path, tok, data_cfg)
    assert len(ds) == 1 and ds[0]["prompt_ids"] == tok.encode(SHORT, add_special_tokens=False)
    assert "dropped 2 of 3 rows of " + path in caplog.text
    assert "recurrent.memory.config.max_prompt_length=" in caplog.text
    # the budget fits the long question: nothing is dropped; the filter off: nothing is dropped either
    assert len(MemoryDataset(MemoryConfig(max_prompt_length=long_tokens), path, tok, data_cfg)) == 3
    assert len(MemoryDataset(cfg, path, tok, {**data_cfg, "filter_overlong_prompts": False})) == 3


def test_filtering_every_row_is_an_error_naming_the_file(tmp_path, tok):
    path = write_rows(tmp_path / "all_long.parquet", [LONG])
    with pytest.raises(ValueError, match=r"dropped every row of .*all_long.parquet.*data.max_prompt_length=4"):
        RLHFDataset(path, tok, {"max_prompt_length": 4, "filter_overlong_prompts": True})
