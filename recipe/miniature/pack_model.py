"""Move a trained model off (and back onto) a machine that passes files in small pieces.

The GPU machine returns at most 8 files of 16 MiB per command and forgets everything between
sessions, so a trained model that must outlive its session (e.g. to finish an evaluation later
with the *same* weights) travels as a bf16 tar cut into numbered parts:

    python -m recipe.miniature.pack_model pack --model runs/miniature/rl_model --out /tmp/rl_parts
    python -m recipe.miniature.pack_model unpack --parts DIR [DIR ...] --out rl_model

``pack`` casts floating-point safetensors weights to bfloat16 (the dtype the evaluation serves in,
``evaluate --dtype bfloat16``, so the served model is unchanged), copies every other file as it is,
tars the folder and cuts the tar into ``rl_model.tar.partNNN`` files plus ``rl_model.manifest.json``
(part count, sizes, SHA-256 of the whole tar). ``unpack`` finds the parts in any of the given
folders (they come back spread over several commands' folders), checks that none is missing and
that the SHA-256 matches, and extracts the model.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

PREFIX = "rl_model.tar.part"
MANIFEST = "rl_model.manifest.json"
DEFAULT_PART_BYTES = 9 * 2**20  # 9 MiB: 6 parts, the manifest and a results archive fit one 64 MiB return


def _bf16_safetensors(path: Path) -> bytes:
    import torch
    from safetensors.torch import load_file, save

    tensors = load_file(str(path))
    cast = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    return save(cast, metadata={"format": "pt"})


def pack(model_dir: str | Path, out_dir: str | Path, part_bytes: int = DEFAULT_PART_BYTES) -> dict:
    """Write ``out_dir/rl_model.tar.partNNN`` and the manifest; return the manifest."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model folder (no config.json)")
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
            data = _bf16_safetensors(path) if path.suffix == ".safetensors" else path.read_bytes()
            info = tarfile.TarInfo(str(path.relative_to(model_dir)))
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(PREFIX + "*"):
        old.unlink()
    parts = [blob[i : i + part_bytes] for i in range(0, len(blob), part_bytes)]
    for index, part in enumerate(parts):
        (out_dir / f"{PREFIX}{index:03d}").write_bytes(part)
    manifest = {
        "parts": len(parts),
        "bytes": len(blob),
        "part_bytes": part_bytes,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "source": str(model_dir),
        "dtype": "bfloat16",
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def unpack(part_dirs: list[str | Path], out_dir: str | Path) -> dict:
    """Reassemble the parts found in ``part_dirs`` into the model folder ``out_dir``."""
    found: dict[int, Path] = {}
    manifest = None
    for folder in map(Path, part_dirs):
        if (folder / MANIFEST).is_file():
            manifest = json.loads((folder / MANIFEST).read_text())
        for path in folder.glob(PREFIX + "*"):
            found.setdefault(int(path.name[len(PREFIX) :]), path)
    if manifest is None:
        raise FileNotFoundError(f"no {MANIFEST} in {[str(d) for d in part_dirs]}")
    missing = [i for i in range(manifest["parts"]) if i not in found]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {manifest['parts']} parts missing: {missing[:10]}")
    blob = b"".join(found[i].read_bytes() for i in range(manifest["parts"]))
    digest = hashlib.sha256(blob).hexdigest()
    if digest != manifest["sha256"]:
        raise ValueError(f"SHA-256 of the reassembled tar is {digest}, the manifest says {manifest['sha256']}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(out_dir, filter="data")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipe.miniature.pack_model", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="model folder -> bf16 tar parts + manifest")
    pk.add_argument("--model", required=True)
    pk.add_argument("--out", required=True)
    pk.add_argument("--part-mib", type=float, default=DEFAULT_PART_BYTES / 2**20)
    up = sub.add_parser("unpack", help="parts (in one or more folders) -> model folder")
    up.add_argument("--parts", nargs="+", required=True)
    up.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            m = pack(args.model, args.out, int(args.part_mib * 2**20))
            print(f"packed {args.model}: {m['parts']} parts, {m['bytes'] / 2**20:.1f} MiB, sha256 {m['sha256'][:16]}")
        else:
            m = unpack(args.parts, args.out)
            print(f"unpacked {m['parts']} parts ({m['bytes'] / 2**20:.1f} MiB, sha256 ok) into {args.out}")
    except (FileNotFoundError, ValueError) as exc:
        print(f"pack_model {args.cmd}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
