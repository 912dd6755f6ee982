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
    """Hold ``signum`` back while the block runs: it is delivered (raised again, to the handler in
    place before the block) when the block ends. Python runs signal handlers in the main thread
    whichever thread the kernel picks, so the hold is a handler that notes the signal, not a
    signal mask: ``pthread_sigmask`` masks the calling thread only, and in a process with other
    threads (a multiprocessing pool's) the kernel hands a process-directed signal to one that has
    it unmasked, whose delivery then runs the stop handler inside the block. Off the main thread
    (where no handler can be set) nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signum, lambda received, frame: held.append(received))
    try:
        yield
    finally:
        # a handler set outside Python reads back as None and cannot be put back: the default then
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        if held:
            signal.raise_signal(signum)


def stopped_exit(command: str, exc: BaseException, resume: str) -> tuple[int, str]:
    """The exit status (128 + the signal's number) and the message for a command stopped by
    ``exc`` (a :class:`Stopped` or a KeyboardInterrupt)."""
    signum = exc.signum if isinstance(exc, Stopped) else int(signal.SIGINT)
    name = exc.name if isinstance(exc, Stopped) else "an interrupt (Ctrl-C)"
    return 128 + signum, f"megatron-mis {command}: stopped by {name}{resume}"
