"""Importing user code by name or by file (upstream verl's ``verl.utils.import_utils`` names).

A recipe registers its own pieces (``@register_adv_est``, ``@register_policy_loss``) when its module is imported;
the trainer imports it from a config key (``algorithm.adv_estimator_module``) or from the environment variable
``VERL_USE_EXTERNAL_MODULES`` (comma-separated, imported by ``import verl`` in every process, as upstream).

A module is named either by its dotted import name (``my_recipe.algos``, or upstream's ``pkg://my_recipe.algos``)
or by the path of a ``.py`` file (``recipe/algos.py``, or upstream's ``file://recipe/algos.py``). A file is
executed once per process: loading the same file again (e.g. as ``custom_reward_function.path`` and as
``algorithm.adv_estimator_module``), or a file already imported by its dotted name, returns the loaded module,
so its decorators do not register twice.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Optional, Union

__all__ = [
    "PKG_PATH_PREFIX",
    "FILE_PATH_PREFIX",
    "is_file_spec",
    "load_module",
    "load_extern_object",
    "import_external_libs",
]

PKG_PATH_PREFIX = "pkg://"
FILE_PATH_PREFIX = "file://"


def is_file_spec(spec: str) -> bool:
    """True when ``spec`` names a file (``file://`` prefix, a ``.py`` suffix or a path separator), False for a
    dotted module name."""
    if spec.startswith(PKG_PATH_PREFIX):
        return False
    return spec.startswith(FILE_PATH_PREFIX) or spec.endswith(".py") or "/" in spec or os.sep in spec


def _file_module_name(path: str) -> str:
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = "".join(ch if ch.isalnum() else "_" for ch in os.path.splitext(os.path.basename(path))[0])
    return f"verl_user_module_{stem}_{digest}"


def _module_loaded_from(path: str) -> Optional[ModuleType]:
    real = os.path.realpath(path)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and os.path.realpath(file) == real:
            return module
    return None


def load_module(module_path: str, module_name: Optional[str] = None) -> ModuleType:
    """Import the module named by ``module_path`` (see the module docstring) and return it.

    A file module is registered in ``sys.modules`` (under ``module_name``, or a name derived from its absolute
    path) so that a second load returns it instead of executing the file again. Raises ``FileNotFoundError`` for
    a missing file, ``ModuleNotFoundError`` for an unknown dotted name; errors raised by the module itself
    propagate unchanged.
    """
    if not isinstance(module_path, str) or not module_path:
        raise TypeError(f"module path must be a non-empty string, got {module_path!r}")
    if not is_file_spec(module_path):
        return importlib.import_module(module_path.removeprefix(PKG_PATH_PREFIX).replace("/", "."))
    path = os.path.abspath(os.path.expanduser(module_path.removeprefix(FILE_PATH_PREFIX)))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"module file not found: {path}")
    already = _module_loaded_from(path)
    if already is not None and module_name is None:
        return already  # e.g. imported by its dotted name before
    name = module_name or _file_module_name(path)
    loaded = sys.modules.get(name)
    if loaded is not None:
        if os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
            raise ImportError(f"module name {name!r} is already taken by {getattr(loaded, '__file__', loaded)!r}")
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a Python module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing: a module that imports itself by name finds it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _pickle_by_value(module)
    return module


def _pickle_by_value(module: ModuleType) -> None:
    """Functions of a file module travel by value to Ray workers and process pools (cloudpickle; also Ray's copy):
    the synthetic module name does not exist there (a reward function scored in a worker process, say)."""
    picklers = []
    try:
        import cloudpickle

        picklers.append(cloudpickle)
    except ImportError:  # pragma: no cover - cloudpickle comes with Ray
        pass
    try:
        from ray import cloudpickle as ray_cloudpickle

        picklers.append(ray_cloudpickle)
    except ImportError:  # pragma: no cover
        pass
    for pickler in picklers:
        register = getattr(pickler, "register_pickle_by_value", None)
        if register is not None:
            register(module)


def load_extern_object(module_path: str, object_name: str) -> Any:
    """``getattr(load_module(module_path), object_name)``; ``AttributeError`` naming both when it is missing."""
    module = load_module(module_path)
    if not hasattr(module, object_name):
        raise AttributeError(f"{object_name!r} is not defined in {module_path}")
    return getattr(module, object_name)


def import_external_libs(external_libs: Union[None, str, Sequence[str]] = None) -> list[ModuleType]:
    """Import each named module (a dotted name or a ``.py`` file, see :func:`load_module`); None imports nothing.
    Returns the modules in order."""
    if external_libs is None:
        return []
    if isinstance(external_libs, str):
        external_libs = [external_libs]
    return [load_module(str(lib)) for lib in external_libs]
