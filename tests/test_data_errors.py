"""Bad data files fail with errors that name the file and what is wrong (RLHFDataset and MemoryDataset)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from transformers import AutoTokenizer

from recurrent.impls.memory import MemoryConfig, MemoryDataset
from verl.utils.dataset.rl_dataset import RLHFDataset, read_rows

ROW = {
    "data_source": "hotpotqa",
    "prompt": [{"role": "user", "content": "What is the code?"}],
    "context": "The code is 42.",
    "reward_model": {"style": "rule", "ground_truth": ["42"]},
    "extra_info": {"index": 0},
}


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_empty_parquet_names_its_file(tmp_path, tok):
    good = tmp_path / "good.parquet"
    pd.DataFrame([ROW]).to_parquet(good)
    empty = tmp_path / "empty.parquet"
    pd.DataFrame([ROW]).iloc[:0].to_parquet(empty)  # schema, no rows
    with pytest.raises(ValueError, match=re.escape(f"data file {empty} has no rows")):
        RLHFDataset([str(good), str(empty)], tok, {})
    with pytest.raises(ValueError, match=re.escape(f"data file {empty} has no rows")):
        MemoryDataset(MemoryConfig(), [str(empty)], tok, {"truncation": "center"})
    zero = tmp_path / "zero.parquet"
    zero.write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"data file {zero} is empty (0 bytes)")):
        read_rows(str(zero))
    torn = tmp_path / "torn.parquet"
    torn.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ValueError, match=re.escape(f"cannot read data file {torn}")):
        read_rows(str(torn))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n")
    with pytest.raises(ValueError, match=re.escape(f"data file {blank}")):
        read_rows(str(blank))
    assert len(read_rows(str(good))) == 1


def test_missing_context_column_names_column_and_file(tmp_path, tok):
    good = tmp_path / "good.parquet"
    pd.DataFrame([ROW]).to_parquet(good)
    no_ctx = tmp_path / "no_context.parquet"
    pd.DataFrame([{k: v for k, v in ROW.items() if k != "context"}]).to_parquet(no_ctx)
    with pytest.raises(ValueError) as err:
        MemoryDataset(MemoryConfig(), [str(good), str(no_ctx)], tok, {"truncation": "center"})
    msg = str(err.value)
    assert "missing column 'context'" in msg and str(no_ctx) in msg and str(good) not in msg
    assert "recurrent.memory.config.context_key" in msg and "'prompt'" in msg  # the columns it does have
    # a custom context_key is the column asked for
    with pytest.raises(ValueError, match=r"missing column 'doc' \(recurrent.memory.config.context_key\) in .*good"):
        MemoryDataset(MemoryConfig(context_key="doc"), [str(good)], tok, {"truncation": "center"})
    assert len(MemoryDataset(MemoryConfig(), [str(good)], tok, {"truncation": "center"})) == 1


def test_missing_prompt_column_names_column_and_file(tmp_path, tok):
    path = tmp_path / "q.parquet"
    pd.DataFrame([{"question": "q?", "data_source": "x"}]).to_parquet(path)
    with pytest.raises(ValueError, match=rf"missing column 'prompt' \(data.prompt_key\) in {re.escape(str(path))}"):
        RLHFDataset([str(path)], tok, {})
