"""Print the markdown tables of a benchmark-suite output folder (the ``<name>.json`` files).

    python benchmarks/suite_tables.py /tmp/h200_out

Reads update_policy.json, rollout.json, memory_agent.json, weight_sync.json and train_step.json (those
present); a missing or unreadable file is reported as such. Exit status 1 if any is missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bench_common  # noqa: F401  (puts the repository root on sys.path)


def _tables():
    from bench_memory_agent_scale import memory_agent_table
    from bench_rollout import rollout_table
    from bench_train_step import train_step_table
    from bench_update_policy import update_policy_table
    from bench_weight_sync import weight_sync_table

    return {
        "update_policy": ("3. update_policy MFU", update_policy_table),
        "rollout": ("1. Rollout tokens/s", rollout_table),
        "memory_agent": ("2. Memory agent: time per chunk, short vs long document", memory_agent_table),
        "weight_sync": ("4. Weight sync", weight_sync_table),
        "train_step": ("5. One training step by phase", train_step_table),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    missing = 0
    for name, (title, table) in _tables().items():
        path = out / f"{name}.json"
        print(f"\n## {title} ({path.name})\n")
        if not path.exists():
            print(f"(missing: {path}; see {name}.log or the log of the script that writes it)")
            missing += 1
            continue
        try:
            print(table(json.loads(path.read_text(encoding="utf-8"))))
        except Exception as exc:  # a malformed report: say so, go on
            print(f"(cannot render {path}: {type(exc).__name__}: {exc})")
            missing += 1
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
