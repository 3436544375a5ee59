"""Long-context dataset synthesis for MemAgent (docs/spec.md#data-formats); see docs/data.md for the commands.

Modules (each CLI runs with ``python -m taskutils.memory_data.<name>``):

* ``hotpotqa_synth`` — HotpotQA train/dev parquet with D documents and ``eval_{D}.json`` sets (CLI).
* ``filter_answerable`` — drop questions answerable without context via OpenAI-compatible servers (CLI).
* ``ruler`` — RULER tasks with separate question and haystack: ``eval_{task}_{length}.json`` (CLI).
* ``synthetic_qa`` — small needle QA in essay haystacks for the CPU demo / miniature runs (CLI + library).
* ``sources`` (HotpotQA/SQuAD readers with validation), ``documents`` (selection, layout, rendering),
  ``haystack``, ``tokens`` (memory-bounded token counting, size search), ``io_utils``, ``wordlists``.
"""
