"""``benchmarks/bench_block_mask.py``: the MemAgent micro-batch layout it builds, and a run whose masks are
checked against torch's ``create_block_mask`` (every field) and whose report holds the timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_block_mask as bbm  # noqa: E402


def test_the_layout_fills_the_budget_with_groups_and_rows_alone():
    segment_ids, prefix_ids, position_ids = bbm.memagent_layout(5000, 100, 20, 4, 0.5, seed=1)
    assert segment_ids.numel() == prefix_ids.numel() == position_ids.shape[1] == 5000
    assert torch.all(torch.diff(segment_ids) >= 0) and torch.all(prefix_ids <= segment_ids)
    shared = prefix_ids != segment_ids
    assert 0 < int(shared.sum()) < 5000  # responses of groups point at their prompt; rows alone at themselves
    # one document per segment: positions restart exactly where a segment starts
    starts = torch.diff(segment_ids, prepend=segment_ids[:1] - 1) != 0
    assert torch.equal(position_ids[0] == 0, starts)
    # every response of a group points at a 100-token prompt segment right before its group's responses
    for segment in prefix_ids[shared].unique().tolist():
        assert int((segment_ids == segment).sum()) == 100


def test_a_run_checks_the_masks_against_torch_and_reports_times(tmp_path, capsys):
    out = tmp_path / "block_mask.json"
    bbm.main(["--tokens", "1024", "3000", "--reference-max", "3000", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["results"]] == [1024, 3000]
    assert [r["blocks"] for r in report["results"]] == [8, 24]
    for row in report["results"]:
        assert row["equal_to_reference"] is True
        assert row["vs_reference"] == row["reference_ms"] / row["shared_prompt_block_mask_ms"]
        assert row["shared_prompt_block_mask_ms"] > 0 and row["packed_block_mask_ms"] > 0
    assert "| 3,000 | 24 |" in capsys.readouterr().out
    skipped = bbm.main(["--tokens", "2048", "--reference-max", "1024", "--repeats", "1"])["results"][0]
    assert skipped["reference_ms"] is None and skipped["equal_to_reference"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "4096", "0"], "--tokens must be at least 1, got 0"),
        (["--group", "0"], "--group must be at least 1, got 0"),
        (["--shared-frac", "1.5"], "--shared-frac must be within [0, 1], got 1.5"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        bbm.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_block_fill_counts_attended_pairs_against_whole_blocks():
    """Hand-counted: one causal document of 256 tokens is 3 blocks of 128 x 128 (two on the diagonal, one full) for
    256 * 257 / 2 attended pairs; two documents of 128 are 2 diagonal blocks; a 128-token prompt shared by two
    64-token responses is 3 blocks (the responses' block sees the whole prompt block) for 8,256 + 2 * (2,080 +
    64 * 128) pairs. Per-document tiles of 128 match flex's blocks where documents fill whole blocks."""
    from verl.workers.actor.packed_block_mask import packed_block_mask, shared_prompt_block_mask

    one = torch.zeros(256, dtype=torch.long)
    assert bbm.attended_pairs(one, one) == 32896
    assert bbm.block_fill(packed_block_mask(torch.arange(256)[None]), 32896) == pytest.approx(32896 / (3 * 128 * 128))
    assert bbm.document_tile_fill(one) == pytest.approx(32896 / (3 * 128 * 128))

    two = torch.arange(2).repeat_interleave(128)
    positions = torch.arange(128).repeat(2)[None]
    assert bbm.attended_pairs(two, two) == 16512
    assert bbm.block_fill(packed_block_mask(positions), 16512) == pytest.approx(16512 / (2 * 128 * 128))

    segments = torch.tensor([0] * 128 + [1] * 64 + [2] * 64)
    prefixes = torch.zeros(256, dtype=torch.long)
    pairs = bbm.attended_pairs(segments, prefixes)
    assert pairs == 8256 + 2 * (2080 + 64 * 128)
    assert bbm.block_fill(shared_prompt_block_mask(segments, prefixes), pairs) == pytest.approx(pairs / (3 * 128 * 128))


def test_the_report_gives_the_block_fill():
    """The report's fills are those of its layout's masks (recomputed here), between 0 and 1."""
    from verl.workers.actor.packed_block_mask import packed_block_mask, shared_prompt_block_mask

    row = bbm.main(["--tokens", "4096", "--reference-max", "1", "--repeats", "1"])["results"][0]
    for key in ("shared_block_fill", "packed_block_fill", "document_tile_fill"):
        assert 0.3 < row[key] <= 1.0, (key, row[key])
    segments, prefixes, positions = bbm.memagent_layout(4096, 700, 128, 8, 0.12, seed=0)  # the defaults
    shared = bbm.block_fill(shared_prompt_block_mask(segments, prefixes), bbm.attended_pairs(segments, prefixes))
    assert row["shared_block_fill"] == pytest.approx(shared)
    plain = bbm.block_fill(packed_block_mask(positions), bbm.attended_pairs(segments, segments))
    assert row["packed_block_fill"] == pytest.approx(plain)
    assert row["document_tile_fill"] == pytest.approx(bbm.document_tile_fill(segments))
