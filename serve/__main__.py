"""``python -m serve``: start OpenAI-compatible vLLM server(s); see :mod:`serve.vllm_server`."""

import sys

from serve.vllm_server import main

if __name__ == "__main__":
    sys.exit(main())
