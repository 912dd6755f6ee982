"""SIGTERM as a clean stop for the long-running commands (``demo``, ``study``).

A batch scheduler's preemption or time limit, ``kill`` of a background launch (whose SIGINT a
non-interactive shell leaves ignored) and ``timeout`` send SIGTERM, whose default action kills the
parent at once: its worker processes run on as orphans, their scratch folders stay, and whatever
the command writes on the way out (the study's run archive) is never written. Inside
:func:`stop_on_sigterm` a SIGTERM raises :class:`Stopped` instead, so the command's ``finally``
blocks run as they do for Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Stopped(BaseException):
    """A command stopped by a signal (a BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` on the way takes it for a failure)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Stopped` in the main thread; a second SIGTERM
    gets the default action (kill at once). The previous handler is restored on the way out; off
    the main thread (where no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferring(signum: int) -> Iterator[None]:
    """Hold ``signum`` back while the block runs (it is delivered when the block ends); a no-op
    where the platform has no ``pthread_sigmask`` (Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})


def stopped_exit(command: str, exc: BaseException, resume: str) -> tuple[int, str]:
    """The exit status (128 + the signal's number) and the message for a command stopped by
    ``exc`` (a :class:`Stopped` or a KeyboardInterrupt)."""
    signum = exc.signum if isinstance(exc, Stopped) else int(signal.SIGINT)
    name = exc.name if isinstance(exc, Stopped) else "an interrupt (Ctrl-C)"
    return 128 + signum, f"megatron-mis {command}: stopped by {name}{resume}"
