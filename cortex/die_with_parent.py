"""A child process that must not outlive its parent (the supervisor's children, ingest's event shards)."""

from __future__ import annotations

import contextlib
import ctypes
import signal


def die_with_parent() -> None:
    """Run in the child between fork and exec (`preexec_fn`): Linux delivers SIGTERM to it when the parent thread that
    forked it exits, even a SIGKILLed one. Elsewhere a no-op (the children also watch for it themselves where it
    matters)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
