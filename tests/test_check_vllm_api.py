"""``scripts/check_vllm_api.py``: the vLLM surface the rollout code uses, read from a release's source."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from scripts import check_vllm_api as checker

pytest.importorskip("vllm")


def _installed_root() -> Path:
    return checker.Source.open(None).root


def _copy_used_modules(dest: Path) -> None:
    """The installed vLLM's files the checks read (and the package ``__init__`` files), nothing else."""
    src = _installed_root()
    modules = set(checker.MODULE_NAMES) | {m for m, _ in checker.CLASS_MEMBERS} | {m for m, _, _ in checker.PARAMETERS}
    modules |= {"vllm._version", "vllm.distributed.parallel_state", "vllm.model_executor.model_loader.reload.layerwise"}
    for module in modules:
        base = module.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if (src / rel).exists():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src / rel, dest / rel)


def test_the_installed_vllm_has_everything_the_rollout_code_uses(capsys):
    assert checker.main([]) == 0
    out = capsys.readouterr().out
    assert "MISSING" not in out and "checks passed" in out


def test_a_missing_method_a_field_and_a_parameter_are_reported(tmp_path, capsys):
    """A copy of the installed vLLM's files with ``LLMEngine.step`` renamed, ``EngineArgs.kv_cache_dtype`` gone and
    ``AsyncLLM.generate`` without ``request_id``; read as a source tree and as a wheel."""
    _copy_used_modules(tmp_path)
    engine = tmp_path / "vllm/v1/engine/llm_engine.py"
    text = engine.read_text()
    assert "    def step(self)" in text
    engine.write_text(text.replace("    def step(self)", "    def step_renamed(self)"))
    args = tmp_path / "vllm/engine/arg_utils.py"
    lines = args.read_text().splitlines(keepends=True)
    field_lines = [i for i, line in enumerate(lines) if line.startswith("    kv_cache_dtype:")]
    assert len(field_lines) == 1
    del lines[field_lines[0]]
    args.write_text("".join(lines))
    async_llm = tmp_path / "vllm/v1/engine/async_llm.py"
    text = async_llm.read_text()
    start = text.index("    async def generate(")
    head, rest = text[:start], text[start:]
    rest = rest.replace("request_id: str,", "rid: str,", 1)
    assert rest != text[start:]
    async_llm.write_text(head + rest)

    expected = {
        "vllm.v1.engine.llm_engine.LLMEngine": "missing ['step']",
        "vllm.engine.arg_utils.EngineArgs": "missing ['kv_cache_dtype']",
        "vllm.v1.engine.async_llm.AsyncLLM.generate()": "missing parameters ['request_id']",
    }
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for file in (tmp_path / "vllm").rglob("*.py"):
            zf.write(file, file.relative_to(tmp_path).as_posix())
    for path in (tmp_path, wheel):
        results = checker.check(checker.Source.open(str(path)))
        failed = {what: detail for what, ok, detail in results if not ok}
        assert failed == expected, path
        assert checker.main([str(path)]) == 1
        assert f"{len(results) - 3}/{len(results)} checks passed; 3 required missing" in capsys.readouterr().out


def test_what_the_project_falls_back_from_is_reported_but_does_not_fail(tmp_path, capsys):
    """Without the layer-wise reload package (older vLLM) weight sync uses the model's own load_weights."""
    _copy_used_modules(tmp_path)
    shutil.rmtree(tmp_path / "vllm/model_executor/model_loader/reload")
    assert checker.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "absent  vllm.model_executor.model_loader.reload: module not found (optional: weight sync falls back" in out
    assert "; 0 required missing" in out


def test_bad_paths_say_what_was_expected(tmp_path):
    with pytest.raises(SystemExit, match="not a wheel, nor a folder holding vllm/__init__.py"):
        checker.Source.open(str(tmp_path))
