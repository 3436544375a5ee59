"""Readers for the raw QA sources (HotpotQA distractor JSON, SQuAD 2.0 JSON) with input validation.

Both readers build the document model of docs/spec.md#document-model:

* HotpotQA: every (title, sentences) paragraph of every question becomes the document
  ``"{title}\\n{''.join(sentences)}"``; the pool is the **sorted set** of unique documents. A question
  keeps its own paragraphs (2 supporting + 8 distractors in the distractor setting) as ``doc_ids``
  and the supporting ones (titles named in ``supporting_facts``) as ``gold_doc_ids``.
* SQuAD: the pool is the sorted set of unique paragraph texts; each answerable question keeps its
  own paragraph (``doc_ids`` = ``gold_doc_ids``), all answer texts, and the other paragraphs of the
  same article as ``more_doc_ids``. Unanswerable questions (``is_impossible``) are skipped.

Malformed rows raise :class:`DataFormatError` naming the file, the row and the field, unless
``skip_malformed=True`` (then they are logged and left out).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class DataFormatError(ValueError):
    """A malformed input row; the message names the file, the row and the offending field."""


@dataclass
class QAItem:
    """One question with its answers and the pool indices of its documents."""

    index: int
    """Position of the question in its source (HotpotQA list index; SQuAD running index of answerable
    questions). Stored as ``extra_info.index`` / eval ``index``."""
    qid: str
    question: str
    answers: list[str]
    doc_ids: list[int]
    """The question's own documents (pool indices, no duplicates, source order)."""
    gold_doc_ids: list[int]
    """Documents that support the answer (subset of ``doc_ids``)."""
    more_doc_ids: list[int] = field(default_factory=list)
    """Preferred distractors (SQuAD: other paragraphs of the same article)."""


@dataclass
class QASource:
    """A document pool plus the questions that refer to it."""

    path: str
    kind: str  # "hotpotqa" or "squad"
    docs: list[str]
    items: list[QAItem]

    def item_by_index(self) -> dict[int, QAItem]:
        """Map ``QAItem.index`` -> item."""
        return {item.index: item for item in self.items}


def _load_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise DataFormatError(f"{path}: not valid JSON ({exc})") from exc


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _check_hotpotqa_row(row: Any, where: str) -> None:
    """Raise DataFormatError (message starts with ``where``) if ``row`` is not a usable HotpotQA row."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: row is a {type(row).__name__}, expected an object")
    if "question" not in row:
        raise DataFormatError(f"{where}: field 'question' is missing")
    if not _nonempty_str(row["question"]):
        raise DataFormatError(f"{where}: field 'question' is empty or not a string: {row['question']!r}")
    if "answer" not in row:
        raise DataFormatError(f"{where}: field 'answer' is missing")
    if not isinstance(row["answer"], str):
        raise DataFormatError(
            f"{where}: field 'answer' must be a string, got {type(row['answer']).__name__}: {row['answer']!r}"
        )
    if not row["answer"].strip():
        raise DataFormatError(f"{where}: field 'answer' is empty")
    if "context" not in row:
        raise DataFormatError(f"{where}: field 'context' is missing")
    context = row["context"]
    if not isinstance(context, list) or not context:
        raise DataFormatError(f"{where}: field 'context' must be a non-empty list of [title, sentences]")
    for j, para in enumerate(context):
        ok = (
            isinstance(para, (list, tuple))
            and len(para) == 2
            and isinstance(para[0], str)
            and isinstance(para[1], list)
            and all(isinstance(s, str) for s in para[1])
        )
        if not ok:
            raise DataFormatError(f"{where}: field 'context[{j}]' must be [title: str, sentences: list[str]]")
    facts = row.get("supporting_facts", [])
    facts_ok = isinstance(facts, list) and all(
        isinstance(f, (list, tuple)) and f and isinstance(f[0], str) for f in facts
    )
    if not facts_ok:
        raise DataFormatError(f"{where}: field 'supporting_facts' must be a list of [title, sentence_id]")


def _validated_rows(
    rows: list[Any],
    path: Path,
    check: Callable[[Any, str], None],
    describe: Callable[[int, Any], str],
    skip_malformed: bool,
) -> list[tuple[int, Any]]:
    good = []
    for i, row in enumerate(rows):
        try:
            check(row, f"{path}: {describe(i, row)}")
        except DataFormatError as exc:
            if not skip_malformed:
                raise
            logger.warning("skipping malformed row: %s", exc)
            continue
        good.append((i, row))
    return good


def _well_formed_paragraphs(row: Any) -> list[Any]:
    context = row.get("context") if isinstance(row, dict) else None
    if not isinstance(context, list):
        return []
    return [
        p
        for p in context
        if isinstance(p, (list, tuple))
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], list)
        and all(isinstance(x, str) for x in p[1])
    ]


def hotpotqa_document(title: str, sentences: list[str]) -> str:
    """Document text of one HotpotQA paragraph: title, newline, sentences concatenated as stored."""
    return f"{title}\n{''.join(sentences)}"


def read_hotpotqa(path: str | Path, skip_malformed: bool = False) -> QASource:
    """Read a HotpotQA JSON file (list of questions, distractor/fullwiki format) into a QASource.

    Raises:
        DataFormatError: for a malformed row (missing/empty question, non-string answer, missing or
            malformed context), naming the file, the row number and its ``_id``, and the field.
    """
    path = Path(path)
    data = _load_json(path)
    if not isinstance(data, list):
        raise DataFormatError(f"{path}: expected a JSON list of HotpotQA questions, got {type(data).__name__}")

    def describe(i: int, row: Any) -> str:
        qid = row.get("_id") if isinstance(row, dict) else None
        return f"row {i}" + (f" (_id={qid!r})" if qid is not None else "")

    rows = _validated_rows(data, path, _check_hotpotqa_row, describe, skip_malformed)
    # The pool holds every well-formed paragraph of the file, also those of skipped rows, so that
    # document indices agree with a pool built from the whole file (index-only eval contexts).
    all_docs = sorted({hotpotqa_document(p[0], p[1]) for row in data for p in _well_formed_paragraphs(row)})
    doc_index = {d: k for k, d in enumerate(all_docs)}
    items = []
    for i, row in rows:
        gold_titles = {f[0] for f in row.get("supporting_facts", [])}
        own: list[int] = []
        gold: list[int] = []
        for title, sentences in row["context"]:
            k = doc_index[hotpotqa_document(title, sentences)]
            if k not in own:
                own.append(k)
                if title in gold_titles:
                    gold.append(k)
        items.append(QAItem(i, str(row.get("_id", i)), row["question"].strip(), [row["answer"]], own, gold))
    return QASource(str(path), "hotpotqa", all_docs, items)


def _check_squad_qa(qa: Any, where: str) -> None:
    if not isinstance(qa, dict):
        raise DataFormatError(f"{where}: entry is a {type(qa).__name__}, expected an object")
    if "question" not in qa:
        raise DataFormatError(f"{where}: field 'question' is missing")
    if not _nonempty_str(qa["question"]):
        raise DataFormatError(f"{where}: field 'question' is empty or not a string: {qa['question']!r}")
    answers = qa.get("answers", [])
    if not isinstance(answers, list):
        raise DataFormatError(f"{where}: field 'answers' must be a list")
    for j, ans in enumerate(answers):
        text = ans.get("text") if isinstance(ans, dict) else ans
        if not isinstance(text, str):
            raise DataFormatError(
                f"{where}: field 'answers[{j}].text' must be a string, got {type(text).__name__}: {text!r}"
            )


def read_squad(path: str | Path, skip_malformed: bool = False) -> QASource:
    """Read a SQuAD (v1.1/v2.0) JSON file into a QASource of its answerable questions.

    Raises:
        DataFormatError: for a malformed entry, naming the file, the entry
            (``data[a].paragraphs[p].qas[q]``) and the field.
    """
    path = Path(path)
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DataFormatError(f"{path}: expected a SQuAD object with a 'data' list")
    entries = []  # (article number, paragraph text, qa)
    paragraphs_of_article: dict[int, list[str]] = {}
    for a, article in enumerate(data["data"]):
        paras = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paras, list):
            raise DataFormatError(f"{path}: data[{a}]: field 'paragraphs' is missing or not a list")
        for p, para in enumerate(paras):
            where = f"{path}: data[{a}].paragraphs[{p}]"
            try:
                if not isinstance(para, dict) or "context" not in para:
                    raise DataFormatError(f"{where}: field 'context' is missing")
                if not _nonempty_str(para["context"]):
                    raise DataFormatError(f"{where}: field 'context' is empty or not a string")
                if not isinstance(para.get("qas", []), list):
                    raise DataFormatError(f"{where}: field 'qas' must be a list")
            except DataFormatError as exc:
                if not skip_malformed:
                    raise
                logger.warning("skipping malformed paragraph: %s", exc)
                continue
            paragraphs_of_article.setdefault(a, []).append(para["context"])
            for q, qa in enumerate(para.get("qas", [])):
                qid = f" (id={qa.get('id')!r})" if isinstance(qa, dict) and "id" in qa else ""
                qwhere = f"{where}.qas[{q}]{qid}"
                try:
                    _check_squad_qa(qa, qwhere)
                except DataFormatError as exc:
                    if not skip_malformed:
                        raise
                    logger.warning("skipping malformed question: %s", exc)
                    continue
                entries.append((a, para["context"], qa))
    all_docs = sorted({c for cs in paragraphs_of_article.values() for c in cs})
    doc_index = {d: k for k, d in enumerate(all_docs)}
    items = []
    for a, context, qa in entries:
        texts = [ans["text"] if isinstance(ans, dict) else ans for ans in qa.get("answers", [])]
        answers = list(dict.fromkeys(t for t in texts if t.strip()))
        if qa.get("is_impossible", False) or not answers:
            continue
        own = doc_index[context]
        more = list(dict.fromkeys(doc_index[c] for c in paragraphs_of_article[a] if doc_index[c] != own))
        qid = str(qa.get("id", len(items)))
        items.append(QAItem(len(items), qid, qa["question"].strip(), answers, [own], [own], more))
    return QASource(str(path), "squad", all_docs, items)


def read_qa_source(path: str | Path, kind: str, skip_malformed: bool = False) -> QASource:
    """Dispatch to :func:`read_hotpotqa` (kind "hotpotqa") or :func:`read_squad` (kind "squad")."""
    if kind == "hotpotqa":
        return read_hotpotqa(path, skip_malformed)
    if kind == "squad":
        return read_squad(path, skip_malformed)
    raise ValueError(f"unknown QA source kind {kind!r} (expected 'hotpotqa' or 'squad')")
