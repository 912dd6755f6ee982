"""``DeferredCount`` (core/engine.py) on its CUDA branch: the non-finite count of a micro-batch is
copied to pinned host memory without blocking and read only once a CUDA event recorded after
that copy has completed (issue 33: "the CUDA event never recorded" survived every test, since the
branch only runs on a GPU).

``torch.cuda.Event`` is replaced, inside the fake-CUDA harness, by :class:`_DeviceEvent`, which
answers as the device would: an event whose recorded work the device has not reached yet is not
complete, and an event that was never recorded IS complete (``cudaEventQuery`` returns
``cudaSuccess`` for an event with no recorded work). So a missing ``record()`` turns into a read
of a host buffer the copy may not have written yet, which these tests see.
"""

from __future__ import annotations

import warnings
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from megatron_mis.testing.fake_cuda import EXPLICIT_SYNC, SyncProbe

aten = torch.ops.aten


class _Stream:
    """The one current stream of these tests (identity is what is checked)."""


CURRENT = _Stream()


class _DeviceEvent:
    """A ``torch.cuda.Event`` that completes when the test says the device got past it."""

    def __init__(self, log: list, *args, **kwargs) -> None:
        self.log, self.stream, self.recorded, self.device_done, self.queries = log, None, False, False, 0
        log.append(("event", self))

    def record(self, stream=None) -> None:
        self.recorded, self.stream = True, stream if stream is not None else torch.cuda.current_stream()
        self.log.append(("record", self))

    def query(self) -> bool:
        self.queries += 1
        return self.device_done or not self.recorded  # never recorded: no pending work, complete

    def synchronize(self) -> None:  # blocks the host: the probe fails the test
        SyncProbe.current.record(EXPLICIT_SYNC, "torch.cuda.Event.synchronize")
        self.device_done = True

    def wait(self, stream=None) -> None:
        pass


@pytest.fixture
def device(fake_probe):
    probe = fake_probe
    """Installs :class:`_DeviceEvent` and the single current stream inside the fake-CUDA harness
    (undone before the harness restores its own), and logs every device-to-host copy so that the
    order of copy and record can be checked. Yields ``(events, log)``."""
    log: list = []
    events: list = []
    real_run = probe._run

    def run(func, args, kwargs):
        if func is aten.copy_.default and args[1].device.type == "cuda" and args[0].device.type == "cpu":
            log.append(("d2h copy", bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))))
        return real_run(func, args, kwargs)

    def make(*args, **kwargs):
        ev = _DeviceEvent(log, *args, **kwargs)
        events.append(ev)
        return ev

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "Event", make)
        m.setattr(torch.cuda, "current_stream", lambda device=None: CURRENT)
        m.setattr(probe, "_run", run)
        yield events, log


def test_the_event_is_recorded_after_the_copy_and_the_count_is_read_only_once_it_completed(fake_probe, device):
    probe = fake_probe
    """engine.py DeferredCount.__init__ / poll: record() on the current stream right after the
    non-blocking copy into pinned memory; poll() reads nothing while the event is pending, never
    synchronises, and returns the count once the device has passed the record point."""
    from megatron_mis.core.engine import DeferredCount

    events, log = device
    deferred = DeferredCount(probe.cuda(torch.tensor(3, dtype=torch.int64)))
    assert len(events) == 1
    event = events[0]
    assert event.recorded, "DeferredCount never records its CUDA event: poll() would read the buffer at once"
    assert event.stream is CURRENT
    kinds = [k for k, _ in log]
    assert kinds == ["d2h copy", "event", "record"], log  # the copy is enqueued before the record point
    assert log[0][1] is True  # non_blocking=True (a blocking copy would be a host read: probe below)
    assert deferred.poll() is None and event.queries == 1  # the device has not reached the event: no read
    assert deferred.poll() is None and event.queries == 2
    event.device_done = True
    assert deferred.poll() == 3
    probe.assert_clean(what="DeferredCount on CUDA")


def test_the_drop_in_reads_each_micro_batch_count_once_its_event_completed(fake_probe, device):
    probe = fake_probe
    """The slime / Miles drop-in keeps each micro-batch's non-finite count as a DeferredCount and
    warns from a later call (tis_functions._warn_deferred_nonfinite). A count whose event is still
    pending at the next call is kept for a later one, not read early and not lost: micro-batch 1
    has one NaN rollout log-prob; at call 2 the device is still behind (no warning, no read); at
    call 3 both events completed and the warning gives 1."""
    from megatron_mis.integrations import tis_functions

    events, _ = device
    trivial = SimpleNamespace(size=1, rank=0, group=None)
    state = SimpleNamespace(cp=trivial, tp=trivial, intra_dp=trivial, is_pp_last_stage=True)
    args = Namespace(custom_config_path=None, use_tis=True)

    def call(nan: bool):
        rollout = torch.tensor([-1.0, -1.2, -0.8])
        if nan:
            rollout[1] = float("nan")
        train = [probe.cuda(rollout.nan_to_num(-1.0) + 0.1)]
        return tis_functions.compute_mis_weights_with_cp(
            args, pg_loss=probe.cuda(torch.ones(3)), train_log_probs=train, rollout_log_probs=[probe.cuda(rollout)],
            loss_masks=[probe.cuda(torch.ones(3))], total_lengths=[5], response_lengths=[3], parallel_state=state,
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(nan=True)
        assert len(events) == 1 and events[0].recorded
        call(nan=False)  # the device has not reached micro-batch 1's event yet
        assert len(events) == 2 and events[0].queries >= 1
        assert not [w for w in caught if "NaN or inf" in str(w.message)]
        for ev in events:
            ev.device_done = True
        call(nan=False)
    hits = [str(w.message) for w in caught if "NaN or inf" in str(w.message)]
    assert len(hits) == 1 and "1 loss-mask token(s)" in hits[0], hits
    probe.assert_clean(what="the drop-in's deferred non-finite count")
