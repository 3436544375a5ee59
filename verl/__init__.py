"""verl-compatible RL core. ``from verl import DataProto`` works as in upstream verl (0.9 API).

``__version__`` is this package's version (pyproject.toml), not upstream verl's.

``DataProto`` and ``DataProtoItem`` are resolved on first use (PEP 562 module ``__getattr__``): ``verl.protocol``
imports torch and tensordict (~3 s per process on 2 CPU cores), which a process that imports only a torch-free part
of ``verl`` (a Ray worker of ``verl.single_controller``, a config or data command) does not need.

As upstream, ``VERL_USE_EXTERNAL_MODULES=mod_a,path/to/b.py`` imports those modules when ``verl`` is imported (in
the trainer and in every worker process that inherits the environment), so the estimators and policy losses they
register (``@register_adv_est``, ``@register_policy_loss``) can be selected by name (see
``verl/utils/import_utils.py``).
"""

import os

from verl.utils.compile_threads import remember_user_setting

remember_user_setting()  # before any vLLM import overrides TORCHINDUCTOR_COMPILE_THREADS (compile_threads.py)

__version__ = "0.1.0"

__all__ = ["DataProto", "DataProtoItem", "__version__"]
_FROM_PROTOCOL = ("DataProto", "DataProtoItem")


def __getattr__(name: str):
    """``verl.DataProto`` / ``from verl import DataProto``: imports ``verl.protocol`` on first use."""
    if name in _FROM_PROTOCOL:
        from verl import protocol

        value = getattr(protocol, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_PROTOCOL))


if os.getenv("VERL_USE_EXTERNAL_MODULES", "").strip():
    from verl.utils.import_utils import import_external_libs

    import_external_libs([m.strip() for m in os.environ["VERL_USE_EXTERNAL_MODULES"].split(",") if m.strip()])
