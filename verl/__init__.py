"""verl-compatible RL core. ``from verl import DataProto`` works as in upstream verl (0.9 API).

``__version__`` is this package's version (pyproject.toml), not upstream verl's.

As upstream, ``VERL_USE_EXTERNAL_MODULES=mod_a,path/to/b.py`` imports those modules when ``verl`` is imported (in
the trainer and in every worker process that inherits the environment), so the estimators and policy losses they
register (``@register_adv_est``, ``@register_policy_loss``) can be selected by name (see
``verl/utils/import_utils.py``).
"""

import os

from verl.protocol import DataProto, DataProtoItem
from verl.utils.compile_threads import remember_user_setting

remember_user_setting()  # before any vLLM import overrides TORCHINDUCTOR_COMPILE_THREADS (compile_threads.py)

__version__ = "0.1.0"

__all__ = ["DataProto", "DataProtoItem", "__version__"]

if os.getenv("VERL_USE_EXTERNAL_MODULES", "").strip():
    from verl.utils.import_utils import import_external_libs

    import_external_libs([m.strip() for m in os.environ["VERL_USE_EXTERNAL_MODULES"].split(",") if m.strip()])
