"""Read evaluation files into validated :class:`EvalItem` rows.

Accepted files (liberal in what we accept, strict about what we run):

* ``.json``: a list of row objects (``eval_{docs}.json``, ``eval_{task}_{len}.json``; docs/spec.md#data-formats),
  or an object holding such a list under ``data``/``rows``/``items``, or one line per row;
* ``.jsonl``: one row object per line (a single line holding a whole list is also accepted, as
  RULER's generators write);
* ``.parquet``: rows of the training/dev schema (``prompt`` chat list, ``context``, docs/spec.md#hotpotqa-synthesis;
  ``reward_model.ground_truth``).

Fields, first match wins:

* question: ``input``, ``question``, ``query``, ``prompt`` (a string or a chat list -> last user
  message), ``extra_info.question``;
* context: ``context``, ``document``, ``documents``, ``haystack``: a string, a list of document
  strings (rendered ``"Document i:\\n..."`` joined by blank lines), or a list of document indices
  into a document pool (``--doc-pool``; the >10,000-document RULER-HotpotQA files store indices);
* gold answers: ``answers``, ``outputs``, ``answer``, ``ground_truth``, ``reward_model.ground_truth``:
  a string or a non-empty list of strings.

A row with a missing context, an empty question, or non-string / missing answers is rejected with
:class:`EvalDataError` naming the file, the row (0-based, = ``_id`` in the results) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EvalDataError",
    "EvalItem",
    "load_doc_pool",
    "load_eval_items",
    "read_rows",
    "render_documents",
]

QUESTION_FIELDS = ("input", "question", "query", "prompt")
CONTEXT_FIELDS = ("context", "document", "documents", "haystack")
ANSWER_FIELDS = ("answers", "outputs", "answer", "ground_truth")


class EvalDataError(ValueError):
    """A malformed evaluation file or row; the message names the file, row and field."""


@dataclass
class EvalItem:
    """One validated evaluation row.

    ``context`` is the document text, or a list of document indices resolved against ``doc_pool``
    by :meth:`get_context` only when the item is run (keeps huge evaluation sets small in memory).
    """

    id: int
    question: str
    context: str | list[int]
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    doc_pool: Sequence[str] | None = None

    def get_context(self) -> str:
        """The document text (rendering index lists against the document pool)."""
        if isinstance(self.context, str):
            return self.context
        assert self.doc_pool is not None  # guaranteed by validation
        return render_documents(self.doc_pool[i] for i in self.context)


def render_documents(documents: Any) -> str:
    """``"Document 1:\\n<doc>\\n\\nDocument 2:\\n<doc>..."`` (docs/spec.md#document-model)."""
    return "\n\n".join(f"Document {i}:\n{doc}" for i, doc in enumerate(documents, start=1))


def _rows_from_json_text(text: str, path: Path) -> list[Any]:
    stripped = text.strip()
    if not stripped:
        return []
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError:
        data = None
        rows: list[Any] = []
        for lineno, line in enumerate(stripped.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalDataError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from None
            rows.extend(value if isinstance(value, list) else [value])
        return rows
    if isinstance(data, dict):
        for key in ("data", "rows", "items"):
            if isinstance(data.get(key), list):
                return data[key]
        return [data]
    if isinstance(data, list):
        return data
    raise EvalDataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")


def read_rows(path: str | Path) -> list[Any]:
    """Raw rows of a ``.json``/``.jsonl``/``.parquet`` evaluation file (no validation)."""
    path = Path(path)
    if not path.is_file():
        raise EvalDataError(f"{path}: evaluation file not found")
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict(orient="records")
    return _rows_from_json_text(path.read_text(encoding="utf-8"), path)


def _to_python(value: Any) -> Any:
    """numpy arrays/scalars from parquet -> lists/python scalars."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def _first_present(row: dict, names: Sequence[str]) -> tuple[str | None, Any]:
    for name in names:
        if name in row and row[name] is not None:
            return name, _to_python(row[name])
    return None, None


def _question_of(row: dict, where: str) -> str:
    name, value = _first_present(row, QUESTION_FIELDS)
    if name is None and isinstance(row.get("extra_info"), dict):
        name, value = "extra_info.question", row["extra_info"].get("question")
    if name is None:
        raise EvalDataError(f"{where}: missing question field (one of {', '.join(QUESTION_FIELDS)})")
    if isinstance(value, list):  # chat messages: the last user turn
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role", "user") == "user"]
        value = users[-1] if users else None
    if not isinstance(value, str):
        raise EvalDataError(f"{where} field '{name}': question must be a string, got {type(value).__name__}")
    if not value.strip():
        raise EvalDataError(f"{where} field '{name}': empty question")
    return value.strip()


def _answers_of(row: dict, where: str) -> list[str]:
    name, value = _first_present(row, ANSWER_FIELDS)
    if name is None and isinstance(row.get("reward_model"), dict):
        name, value = "reward_model.ground_truth", _to_python(row["reward_model"].get("ground_truth"))
    if name is None:
        raise EvalDataError(f"{where}: missing gold answers field (one of {', '.join(ANSWER_FIELDS)})")
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        raise EvalDataError(
            f"{where} field '{name}': answers must be a string or a list of strings, got {type(value).__name__} ({value!r})"
        )
    if not values:
        raise EvalDataError(f"{where} field '{name}': empty list of gold answers")
    for k, answer in enumerate(values):
        if not isinstance(answer, str):
            raise EvalDataError(
                f"{where} field '{name}': answer #{k} is {type(answer).__name__} ({answer!r}), expected a string"
            )
    return list(values)


def _context_of(row: dict, where: str, doc_pool: Sequence[str] | None) -> str | list[int]:
    name, value = _first_present(row, CONTEXT_FIELDS)
    if name is None:
        raise EvalDataError(f"{where}: missing context field (one of {', '.join(CONTEXT_FIELDS)})")
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return render_documents(value)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if doc_pool is None:
            raise EvalDataError(
                f"{where} field '{name}': context is a list of document indices; pass the document pool (--doc-pool)"
            )
        bad = [v for v in value if not 0 <= v < len(doc_pool)]
        if bad:
            raise EvalDataError(
                f"{where} field '{name}': document index {bad[0]} outside the pool of {len(doc_pool)} documents"
            )
        return list(value)
    raise EvalDataError(
        f"{where} field '{name}': context must be a string, a list of strings or a list of document indices, "
        f"got {type(value).__name__}"
    )


def load_eval_items(
    path: str | Path,
    doc_pool: Sequence[str] | None = None,
    limit: int | None = None,
    skip_invalid: bool = False,
) -> tuple[list[EvalItem], list[tuple[int, str]]]:
    """Read and validate every row of ``path``.

    Returns ``(items, invalid)``; ``invalid`` lists ``(row, message)`` pairs and is empty unless
    ``skip_invalid`` is true. ``limit`` keeps the first rows only.

    Raises:
        EvalDataError: on the first malformed row (unless ``skip_invalid``), an unreadable file, or
            a file with no rows. The message names the file, the row and the field.
    """
    path = Path(path)
    rows = read_rows(path)
    if not rows:
        raise EvalDataError(f"{path}: no rows")
    if limit is not None:
        rows = rows[:limit]
    items: list[EvalItem] = []
    invalid: list[tuple[int, str]] = []
    for index, row in enumerate(rows):
        where = f"{path}: row {index}"
        try:
            if not isinstance(row, dict):
                raise EvalDataError(f"{where}: expected an object, got {type(row).__name__}")
            question = _question_of(row, where)
            answers = _answers_of(row, where)
            context = _context_of(row, where, doc_pool)
        except EvalDataError as exc:
            if not skip_invalid:
                raise
            invalid.append((index, str(exc)))
            continue
        skipped = set(CONTEXT_FIELDS) | set(QUESTION_FIELDS) | set(ANSWER_FIELDS)  # stored normalised instead
        meta = {k: _to_python(v) for k, v in row.items() if k not in skipped and _is_json_scalar_or_small(v)}
        items.append(EvalItem(index, question, context, answers, meta, doc_pool))
    return items, invalid


def _is_json_scalar_or_small(value: Any) -> bool:
    value = _to_python(value)
    try:
        return len(json.dumps(value)) < 2000
    except (TypeError, ValueError):
        return False


def load_doc_pool(path: str | Path) -> list[str]:
    """Documents that index-list contexts refer to.

    Accepts a JSON list of document strings, a raw HotpotQA file (list of questions with
    ``context: [[title, [sentences]], ...]``; document = ``title + "\\n" + "".join(sentences)``), or a
    raw SQuAD file (``{"data": [{"paragraphs": [{"context": ...}]}]}``). Raw files give the sorted set
    of unique documents (docs/spec.md#document-model), which is how the indices were assigned.
    """
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, list) and all(isinstance(d, str) for d in data):
        return data
    docs: set[str] = set()
    if isinstance(data, list):  # HotpotQA
        for q in data:
            for title, sentences in q.get("context", []):
                docs.add(f"{title}\n{''.join(sentences)}")
    elif isinstance(data, dict) and isinstance(data.get("data"), list):  # SQuAD
        for article in data["data"]:
            for para in article.get("paragraphs", []):
                docs.add(para["context"])
    else:
        raise EvalDataError(f"{path}: not a document pool (list of strings, HotpotQA or SQuAD file)")
    return sorted(docs)
