"""`megatron_mis.cli.stopping`: SIGTERM as a clean stop for the long-running commands (the
commands' own tests: tests/e2e/test_study_dose.py and tests/e2e/test_demo.py)."""

from __future__ import annotations

import os
import signal

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


def test_the_exit_status_is_128_plus_the_signal_and_names_it():
    assert stopped_exit("study", Stopped(signal.SIGTERM), "; rerun") == (143, "megatron-mis study: stopped by SIGTERM; rerun")
    assert stopped_exit("demo", KeyboardInterrupt(), "") == (130, "megatron-mis demo: stopped by an interrupt (Ctrl-C)")
