"""This process's peak host memory (resident set), as the ``perf/*cpu_memory_peak_rss_gb`` metrics report it."""

from __future__ import annotations

__all__ = ["peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes: the kernel's ``VmHWM`` where ``/proc`` has it (Linux), else
    ``getrusage``'s ``ru_maxrss``. Linux carries ``ru_maxrss`` over a fork and an exec, so a process started by a
    large one (a rank's rollout engine process, a worker forked by a big driver) would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration, ValueError):
        import resource
        import sys

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere
