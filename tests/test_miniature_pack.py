"""recipe.miniature.pack_model and h200_run.sh fetch-model: a trained model leaves the GPU machine in
bf16 parts, a few per command, and comes back whole (same weights as served, checked by SHA-256)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recipe.miniature import pack_model

REPO = Path(__file__).resolve().parents[1]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_pack_and_unpack_give_the_bf16_model_back(tiny_model_path, tmp_path):
    manifest = pack_model.pack(tiny_model_path, tmp_path / "parts", part_bytes=100_000)
    parts = sorted((tmp_path / "parts").glob(pack_model.PREFIX + "*"))
    assert manifest["parts"] == len(parts) > 2 and all(p.stat().st_size <= 100_000 for p in parts)
    assert sum(p.stat().st_size for p in parts) == manifest["bytes"]
    # parts spread over two folders, as they come back from two commands
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for i, part in enumerate(parts):
        shutil.copy(part, tmp_path / ("a" if i % 2 else "b"))
    shutil.copy(tmp_path / "parts" / pack_model.MANIFEST, tmp_path / "b")
    pack_model.unpack([tmp_path / "a", tmp_path / "b"], tmp_path / "model")
    original, restored = _weights(tiny_model_path), _weights(tmp_path / "model")
    assert original.keys() == restored.keys() and original
    for name, tensor in original.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert restored[name].dtype == expected.dtype and torch.equal(restored[name], expected), name
    for path in tiny_model_path.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            assert (tmp_path / "model" / path.name).read_bytes() == path.read_bytes(), path.name


def test_unpack_refuses_missing_or_corrupt_parts(tiny_model_path, tmp_path):
    pack_model.pack(tiny_model_path, tmp_path / "parts", part_bytes=200_000)
    (tmp_path / "parts" / f"{pack_model.PREFIX}001").rename(tmp_path / "aside")
    with pytest.raises(FileNotFoundError, match=r"1 of \d+ parts missing: \[1\]"):
        pack_model.unpack([tmp_path / "parts"], tmp_path / "m1")
    data = bytearray((tmp_path / "aside").read_bytes())
    data[10] ^= 0xFF
    (tmp_path / "parts" / f"{pack_model.PREFIX}001").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        pack_model.unpack([tmp_path / "parts"], tmp_path / "m2")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        pack_model.pack(tmp_path / "parts", tmp_path / "x")
    assert pack_model.main(["unpack", "--parts", str(tmp_path / "nowhere"), "--out", str(tmp_path / "m3")]) == 2


def test_h200_driver_returns_the_model_a_few_parts_per_command(tiny_model_path, tmp_path):
    root, parts = tmp_path / "mini", tmp_path / "parts"
    shutil.copytree(tiny_model_path, root / "rl_model")
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "rl_checkpoint.txt").write_text("/tmp/mini/train/global_step_17\n")
    outs = [tmp_path / f"out{i}" for i in range(3)]
    env = {
        **os.environ,
        "MINI_ROOT": str(root),
        "PARTS_DIR": str(parts),
        "MODEL_PART_MIB": "0.06",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    for out in outs:
        proc = subprocess.run(
            ["bash", str(REPO / "recipe/miniature/h200_run.sh"), "fetch-model"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "OUT": str(out)},
        )
        assert proc.returncode == 0, proc.stderr
        assert (out / pack_model.MANIFEST).is_file() and (out / "results.tgz").is_file()
    manifest = json.loads((parts / pack_model.MANIFEST).read_text())
    returned = [sorted(p.name for p in out.glob(pack_model.PREFIX + "*")) for out in outs]
    assert manifest["parts"] > 6 and len(returned[0]) == 6 and len(returned[0]) + len(returned[1]) == manifest["parts"]
    assert returned[2] == [] and not set(returned[0]) & set(returned[1])
    assert f"0 returned now, {manifest['parts']} of {manifest['parts']} in all" in proc.stdout
    assert (parts / "rl_checkpoint.txt").read_text() == "/tmp/mini/train/global_step_17\n"
    pack_model.unpack(outs, tmp_path / "model")
    assert _weights(tmp_path / "model").keys() == _weights(tiny_model_path).keys()
    # a model that came from parts is not sent back again
    (root / "meta" / ".rl_model_from_parts").touch()
    shutil.rmtree(parts)
    proc = subprocess.run(
        ["bash", str(REPO / "recipe/miniature/h200_run.sh"), "fetch-model"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OUT": str(tmp_path / "out9")},
    )
    assert proc.returncode == 0 and not list((tmp_path / "out9").glob(pack_model.PREFIX + "*"))
