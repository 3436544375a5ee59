"""Print the markdown tables of a benchmark output folder.

    python benchmarks/suite_tables.py /tmp/gpu_out

A ``benchmarks/gpu_suite.sh`` folder: every ``*.json`` report in the folder is recognised by its content
(``"benchmark"``: ``update_policy``, ``train_step``, ``weight_sync``, ``vs_verl``, ``vllm_step``, ``rank_spread``,
``block_mask``; reports of ``bench_update_policy.py`` written before it named itself by their ``log_prob`` and
``update_policy`` sections, of ``bench_vs_verl.py`` by ``spec`` and ``sides``) and tabulated side by side, one table
per kind and one row per report (train_step: one table of steps per report, then a summary across reports). A file that cannot be read, a report of
no kind tabulated here and one with ``"complete": false`` are listed at the end with the reason.

The older one-H200 suite's folder (any of ``update_policy.json``, ``rollout.json``, ``memory_agent.json``,
``weight_sync.json``, ``train_step.json`` present): those five reports, each with its bench's table; a missing or
unreadable one is reported as such.

Exit status 1 if a report is missing, unreadable or incomplete (or the folder holds no report), else 0.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import bench_common as bc  # (also puts the repository root on sys.path)

LEGACY_NAMES = ("update_policy", "rollout", "memory_agent", "weight_sync", "train_step")
KINDS = {  # kind -> section title, in print order
    "update_policy": "update_policy: log-prob and update passes",
    "train_step": "Training step by phase",
    "weight_sync": "Weight sync",
    "vs_verl": "This actor vs upstream verl",
    "vllm_step": "vLLM engine step: wall vs GPU kernel time",
    "rank_spread": "The update over several ranks: rows dealt to ranks vs in their order",
    "block_mask": "BlockMask build per packed micro-batch",
}
LIGER_NOTE = (
    "\\* these reports have no `use_liger` (written before it was recorded): the requested `--liger` is shown as "
    "the resolved value; their `liger_applied` read False even on liger runs and is not used."
)


def _legacy_tables():
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


def legacy_main(out: Path) -> int:
    """The older suite's five fixed reports, each with its bench's table."""
    missing = 0
    for name, (title, table) in _legacy_tables().items():
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


def report_kind(report) -> str | None:
    """The benchmark that wrote ``report`` (its ``"benchmark"`` field, else recognised by its sections)."""
    if not isinstance(report, dict):
        return None
    if report.get("benchmark"):
        return str(report["benchmark"])
    if isinstance(report.get("log_prob"), dict) and isinstance(report.get("update_policy"), dict):
        return "update_policy"
    if isinstance(report.get("spec"), dict) and isinstance(report.get("sides"), dict):
        return "vs_verl"
    return None


def load_reports(folder: Path) -> tuple[dict[str, list[tuple[str, dict]]], list[tuple[str, str]]]:
    """The folder's ``*.json`` reports by kind (``(file name, report)``, sorted by name), and the files that are
    not reports of a kind tabulated here, each with the reason."""
    by_kind: dict[str, list[tuple[str, dict]]] = {kind: [] for kind in KINDS}
    problems = []
    for path in sorted(folder.glob("*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            problems.append((path.name, f"unreadable: {type(exc).__name__}: {exc}"))
            continue
        kind = report_kind(report)
        if kind not in KINDS:
            what = f"benchmark {kind!r}" if kind else "no benchmark recognised"
            problems.append((path.name, f"not tabulated here: {what}"))
            continue
        by_kind[kind].append((path.name, report))
        if report.get("failed"):  # bench_vllm_step: settings whose process failed
            problems.append((path.name, f"incomplete: settings failed: {', '.join(report['failed'])}"))
        if report.get("complete") is False:
            problems.append((path.name, f"incomplete: {report.get('error') or 'a run stopped before its last step'}"))
    return by_kind, problems


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt: str, missing: str = "n/a") -> str:
    return missing if x is None else format(x, fmt)


def _onoff(x) -> str:
    return {True: "on", False: "off"}.get(x, str(x))


def checkpointing(report: dict) -> str:
    """``all``, ``every N`` (selective: ``ckpt_every`` N > 1) or ``none``."""
    if not report.get("grad_ckpt"):
        return "none"
    every = int(report.get("ckpt_every") or 1)
    return "all" if every == 1 else f"every {every}"


def liger_cell(report: dict) -> tuple[str, bool]:
    """The resolved liger setting, and whether it is the requested value standing in (no ``use_liger``)."""
    if "use_liger" in report:
        asked = report.get("liger")
        resolved = _onoff(report["use_liger"])
        return (f"{resolved} ({asked})" if asked == "auto" else resolved), False
    if "liger" not in report:  # written before liger was an option
        return "n/a", False
    return _onoff(report["liger"]) + "\\*", True


def _cannot_render(problems: list, name: str, exc: Exception) -> str:
    """Note ``name``'s failure in ``problems``; the short text its table shows instead."""
    problems.append((name, f"cannot render: {type(exc).__name__}: {exc}"))
    return "cannot render (listed below)"


def update_policy_rows(reports: list[tuple[str, dict]], problems: list) -> str:
    """One row per ``bench_update_policy.py`` report, side by side (a report that fails: noted in ``problems``)."""
    headers = [
        "file",
        "shape",
        "attention",
        "checkpointing",
        "liger",
        "compile_layers",
        "log-prob tok/s/GPU",
        "log-prob MFU",
        "update tok/s/GPU",
        "update MFU",
        "update s",
        "peak GiB",
        "grad norm",
    ]
    rows, footnote = [], False
    for name, r in reports:
        try:
            lp, up = r["log_prob"], r["update_policy"]
            liger, stand_in = liger_cell(r)
            footnote |= stand_in
            compile_layers = r.get("compile_layers")
            rows.append(
                [
                    name,
                    f"{r['shape']} x{r.get('world_size', 1)}",
                    r.get("attn_implementation", "n/a"),
                    checkpointing(r),
                    liger,
                    "n/a" if compile_layers is None else _onoff(compile_layers),
                    _num(lp.get("tokens_per_s_per_gpu"), ",.0f"),
                    _pct(lp.get("mfu")),
                    _num(up.get("tokens_per_s_per_gpu"), ",.0f"),
                    _pct(up.get("mfu")),
                    _num(up.get("seconds"), ".2f"),
                    _num(up.get("peak_mem_gib_rank0"), ".1f"),
                    _num(up.get("grad_norm"), ".5f"),
                ]
            )
        except (KeyError, TypeError, ValueError) as exc:
            rows.append([name, _cannot_render(problems, name, exc), *[""] * (len(headers) - 2)])
    text = bc.markdown_table(headers, rows)
    return text + ("\n\n" + LIGER_NOTE if footnote else "")


def _runs(report: dict) -> list[tuple[str, list[dict]]]:
    """The runs of a train_step report: (label, steps); ``--overlap both`` has two."""
    label = {"off": "sync", "on": "one-step-off"}.get(report.get("rollout_overlap", "off"), "sync")
    runs = [(label, report.get("steps", []))]
    if "overlap_steps" in report:
        runs.append(("one-step-off", report["overlap_steps"]))
    return runs


def _had_rollout_ahead(step: dict) -> bool:
    if "rollout_ahead" in step:
        return bool(step["rollout_ahead"])
    return step.get("update_gen_overlap_frac", 1.0) != 0.0


def step_summary(steps: list[dict], one_step_off: bool = False) -> dict:
    """Over the steps after the first (its one-off warm-ups left out): mean (and min, median, max) total seconds,
    tokens over their seconds, and the update's largest per-phase peak and growth (GiB; None where the report has none).

    ``one_step_off``: a run's last step launches no rollout ahead, so its update runs alone and the step is ~a third
    shorter than the steady state (one H200, 1.5B: 28.6 s vs 43-44 s); steps with no rollout ahead are left out too
    and listed under ``left_out``: by the row's ``rollout_ahead``, or in reports from before it by an update that
    overlapped no generation (``update_gen_overlap_frac`` 0), which also leaves out a step whose rollout ahead had
    finished before its update began (135M, engine in a child process)."""
    later = steps[1:]
    left_out = []
    if one_step_off:
        left_out = [s["step"] for s in later if not _had_rollout_ahead(s)]
        later = [s for s in later if s["step"] not in left_out]
    seconds = sum(s["total"] for s in later)

    def largest(field: str):
        values = [s.get(field, {}).get("update") for s in later]
        values = [v for v in values if v is not None]
        return max(values) if values else None

    totals = sorted(s["total"] for s in later)
    return {
        "steps": [s["step"] for s in later],
        "left_out": left_out,
        "mean_total_s": seconds / len(later) if later else None,
        # the spread of those steps: a per-step target is held (max) or reached once (min)
        "min_total_s": totals[0] if totals else None,
        "median_total_s": statistics.median(totals) if totals else None,
        "max_total_s": totals[-1] if totals else None,
        "tokens_per_s": sum(s["tokens"] for s in later) / seconds if later and seconds > 0 else None,
        # the steps' training-pass MFU over their seconds (bench_train_step.add_mfu; None for reports without it)
        "mfu": sum(s["mfu"] * s["total"] for s in later) / seconds
        if later and seconds > 0 and all("mfu" in s for s in later)
        else None,
        "update_peak_gib": largest("gpu_peak_by_phase_gib"),
        "update_growth_gib": largest("gpu_growth_by_phase_gib"),
        "update_in_use_gib": largest("gpu_in_use_by_phase_gib"),
    }


def train_step_header(name: str, report: dict) -> str:
    model = Path(str(report.get("model", "n/a"))).name
    overrides = " ".join(report.get("overrides") or []) or "none"
    state = "" if report.get("complete", True) else f" **incomplete: {report.get('error') or 'stopped early'}**"
    inert = sorted({line for lines in (report.get("inert_settings") or {}).values() for line in lines})
    no_effect = f"; **no effect**: {'; '.join(inert)}" if inert else ""  # bench_train_step's module docstring
    return (
        f"**{name}**: {model}, overlap {report.get('rollout_overlap', 'off')}, overrides: {overrides}{no_effect}{state}"
    )


def train_step_tables(reports: list[tuple[str, dict]], problems: list) -> str:
    """Per report its steps by phase (``bench_train_step.train_step_table``; with ``--overlap both`` also the
    one-step-off run's and the side-by-side table), then one summary row per run of every report."""
    from bench_train_step import overlap_table, percent, train_step_table

    parts, summary = [], []
    for name, report in reports:
        try:
            parts.append(train_step_header(name, report))
            for label, steps in _runs(report):
                parts.append(f"{label}:\n\n" + train_step_table({**report, "steps": steps}))
                s = step_summary(steps, one_step_off=label == "one-step-off")
                notes = [] if report.get("complete", True) else ["incomplete"]
                if "algorithm.bypass_mode=True" in report.get("overrides", []):
                    notes.append("bypass mode (no old-log-prob pass)")
                if s["left_out"]:
                    notes.append(f"left out: step {', '.join(map(str, s['left_out']))} (no rollout ahead)")
                note = "; ".join(notes)
                summary.append(
                    [
                        name,
                        label,
                        ", ".join(map(str, s["steps"])) or "none",
                        _num(s["mean_total_s"], ".1f"),
                        _num(s["tokens_per_s"], ",.0f"),
                        percent(s["mfu"]),
                        _num(s["update_peak_gib"], ".1f", missing=""),
                        _num(s["update_growth_gib"], ".1f", missing=""),
                        _num(s["update_in_use_gib"], ".1f", missing=""),
                        note,
                    ]
                )
            if report.get("overlap_summary"):
                parts.append(overlap_table(report))
        except (KeyError, TypeError, ValueError) as exc:
            failed = _cannot_render(problems, name, exc)
            parts.append(f"**{name}**: {failed}")
            summary.append([name, "", "", "", "", "", "", "", "", failed])
    headers = [
        *("file", "overlap", "steps", "mean total s", "tokens/s", "step MFU"),
        *("update peak GiB", "update growth GiB", "update in use GiB", "note"),
    ]
    parts.append(
        "Summary over the steps after the first (step 1 carries the one-off warm-ups; one-step-off: also without "
        "its last step, which runs no rollout ahead): mean step seconds, their "
        "tokens over their seconds, the update's largest per-phase GPU peak, growth, and peak less what the sleeping "
        "rollout engine had released (empty: the report has none)\n\n" + bc.markdown_table(headers, summary)
    )
    return "\n\n".join(parts)


def per_report_tables(reports: list[tuple[str, dict]], table, problems: list) -> str:
    """Each report under its file name, with its bench's own ``table``."""
    parts = []
    for name, report in reports:
        try:
            parts.append(f"**{name}**\n\n" + table(report))
        except (KeyError, TypeError, ValueError) as exc:
            parts.append(f"**{name}**: {_cannot_render(problems, name, exc)}")
    return "\n\n".join(parts)


def suite_main(folder: Path) -> int:
    """Every report of ``folder``, tabulated by kind; the files that are not, with the reason."""
    by_kind, problems = load_reports(folder)
    for kind, reports in by_kind.items():
        if not reports:
            continue
        print(f"\n## {KINDS[kind]} ({len(reports)} report(s))\n")
        if kind == "update_policy":
            print(update_policy_rows(reports, problems))
        elif kind == "train_step":
            print(train_step_tables(reports, problems))
        elif kind == "weight_sync":
            from bench_weight_sync import weight_sync_table

            print(per_report_tables(reports, weight_sync_table, problems))
        elif kind == "vllm_step":
            from bench_vllm_step import report_table

            print(per_report_tables(reports, report_table, problems))
        elif kind == "rank_spread":
            from bench_rank_spread import report_table as rank_spread_table

            print(per_report_tables(reports, rank_spread_table, problems))
        elif kind == "block_mask":
            from bench_block_mask import table as block_mask_table

            print(per_report_tables(reports, block_mask_table, problems))
        else:
            from bench_vs_verl import table as vs_verl_table

            print(per_report_tables(reports, vs_verl_table, problems))
    if problems:
        print("\n## Not tabulated or incomplete\n")
        cells = [(name, reason.replace("|", "\\|").replace("\n", " ")) for name, reason in problems]
        print(bc.markdown_table(["file", "reason"], cells))
    if not any(by_kind.values()):
        print(f"(no benchmark report in {folder})")
        return 1
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[0])
    if any((folder / f"{name}.json").exists() for name in LEGACY_NAMES):
        return legacy_main(folder)
    return suite_main(folder)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
