"""`megatron_mis.cli.stopping`: SIGTERM as a clean stop for the long-running commands (the
commands' own tests: tests/e2e/test_study_dose.py and tests/e2e/test_demo.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megatron_mis.cli.stopping import Stopped, deferring, stop_on_sigterm, stopped_exit


def test_the_stop_handler_is_scoped_and_holds_a_signal_back_while_the_archive_is_written():
    """`stop_on_sigterm` turns SIGTERM into a stop (signal 15) only inside the command and puts
    the previous handler back. `deferring` holds SIGTERM back until its block (the study's
    archive update) ends, then it is delivered."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(Stopped) as stopped:
            with stop_on_sigterm():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between bytecodes
                    pass
        assert stopped.value.signum == signal.SIGTERM and stopped.value.name == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # ours again, not the default
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        written = None
        with pytest.raises(Stopped):
            with stop_on_sigterm():
                with deferring(signal.SIGTERM):
                    os.kill(os.getpid(), signal.SIGTERM)
                    written = sum(range(1000))  # held back: the block runs to its end
                raise AssertionError("SIGTERM was not delivered after the block")
        assert written == 499500
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_that_another_thread_receives_is_held_back_too():
    """The kernel gives a process-directed signal to any thread that does not mask it, and Python
    then runs the handler in the main thread: `deferring` holds SIGTERM back even when another
    thread (as a multiprocessing pool's are) is the one that receives it (a per-thread signal mask
    in the main thread did not: the stop ran inside the block whenever another thread existed)."""
    release = threading.Event()
    other = threading.Thread(target=release.wait, daemon=True)
    other.start()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        written, after = None, None
        with pytest.raises(Stopped):
            with stop_on_sigterm():
                with deferring(signal.SIGTERM):
                    os.kill(os.getpid(), signal.SIGTERM)  # to the process: a thread not masking it gets it
                    time.sleep(0.2)  # time for that thread to be woken for it; not a timing assertion
                    for _ in range(1000):  # a handler would run between these bytecodes
                        pass
                    written = sum(range(1000))
                after = "not stopped"
        assert written == 499500 and after is None
    finally:
        release.set()
        other.join()
        signal.signal(signal.SIGTERM, previous)


def test_the_exit_status_is_128_plus_the_signal_and_names_it():
    assert stopped_exit("study", Stopped(signal.SIGTERM), "; rerun") == (143, "megatron-mis study: stopped by SIGTERM; rerun")
    assert stopped_exit("demo", KeyboardInterrupt(), "") == (130, "megatron-mis demo: stopped by an interrupt (Ctrl-C)")
