"""MemAgent evaluation harness: models x methods x tasks x lengths against OpenAI-compatible servers.

Modules: ``run`` (CLI / matrix), ``runner`` (one cell: concurrency, resume), ``agents`` (memory agent
client over ``recurrent.memory_loop``, and the direct baseline), ``batched`` (in-process engine
runner), ``client`` (openai client, retries, endpoint checks), ``chunking`` (lazy token or character
chunks), ``data`` (eval files and validation), ``scoring`` (lenient + strict), ``results`` (JSONL
store), ``summary`` (tables and plot), ``testing`` (scripted fault-injecting server).
See docs/evaluation.md.
"""
