"""``python -m verl.utils.smollm``: ``--help`` prints its usage and converts nothing (it once took ``--help`` as the
cache folder and converted the model into ``./--help``); a converted folder is printed as is; bad dtypes are named."""

from __future__ import annotations

import pytest

from verl.utils import smollm


def test_help_prints_usage_and_converts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(smollm, "gguf_dir", lambda: pytest.fail("--help must not convert"))
    with pytest.raises(SystemExit) as stop:
        smollm.main(["--help"])
    assert stop.value.code == 0
    assert "usage: python -m verl.utils.smollm" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_converted_folder_is_printed_without_converting(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "SmolLM2-135M-Instruct-bfloat16"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(smollm, "gguf_dir", lambda: pytest.fail("already converted"))
    smollm.main([str(tmp_path), "--dtype", "bfloat16"])
    assert capsys.readouterr().out.strip() == str(folder)
    monkeypatch.setenv("MEMAGENT_CACHE", str(tmp_path))
    assert smollm.smollm2_path(dtype="bfloat16") == folder


def test_an_unknown_dtype_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        smollm.main([str(tmp_path), "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype='fp8': expected one of float32, bfloat16, float16"):
        smollm.smollm2_path(tmp_path, dtype="fp8")
