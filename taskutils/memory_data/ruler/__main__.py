"""``python -m taskutils.memory_data.ruler``: see :mod:`taskutils.memory_data.ruler.cli`."""

import sys

from taskutils.memory_data.ruler.cli import main

if __name__ == "__main__":
    sys.exit(main())
