"""verl-compatible RL core. ``from verl import DataProto`` works as in upstream verl (0.9 API).

``__version__`` is this package's version (pyproject.toml), not upstream verl's.
"""

from verl.protocol import DataProto, DataProtoItem

__version__ = "0.1.0"

__all__ = ["DataProto", "DataProtoItem", "__version__"]
