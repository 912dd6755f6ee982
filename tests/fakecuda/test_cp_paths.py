"""The drop-in at CP = 2 on fake ``cuda:0`` tensors (two gloo ranks): the only host
synchronisation is the documented read of the status that rides in the statistics all-gather,
exactly one per call, whatever N — with ``nonfinite_policy: error`` too (its counts ride in the
status: no read of their own)."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from megatron_mis.testing.fake_cuda import fake_cuda_unavailable_reason


def _cp_call(num_seqs: int, mis: dict) -> list[str]:
    """On every rank: this rank's zigzag pieces of num_seqs sequences through
    compute_mis_weights_with_cp on fake CUDA; returns the recorded synchronisations."""
    import torch.distributed as dist

    from megatron_mis.integrations.tis_functions import compute_mis_weights_with_cp
    from megatron_mis.parallel.layout import local_response_layout
    from megatron_mis.testing.fake_cuda import fake_cuda

    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(4, 20, (num_seqs,), generator=g).tolist()
    totals = [r + 3 for r in resp]
    lay = local_response_layout(totals, resp, size, rank, layout="thd")
    local = lay.local_lengths.tolist()
    train = [torch.randn(k, generator=g) * 0.2 - 1.0 for k in local]
    rollout = [t + 0.05 for t in train]
    masks = [torch.ones(r) for r in resp]
    cp = SimpleNamespace(size=size, rank=rank, group=group)
    trivial = SimpleNamespace(size=1, rank=0, group=None)
    state = SimpleNamespace(cp=cp, tp=trivial, intra_dp=trivial, is_pp_last_stage=True)
    with fake_cuda() as probe:
        loss, _, _ = compute_mis_weights_with_cp(
            Namespace(custom_config_path=None, qkv_format="thd", **mis), pg_loss=probe.cuda(torch.zeros(sum(local))),
            train_log_probs=probe.cuda(train), rollout_log_probs=probe.cuda(rollout), loss_masks=probe.cuda(masks),
            total_lengths=totals, response_lengths=resp, parallel_state=state,
        )
        probe.check_outputs([loss])
        return [str(v) for v in probe.violations]


@pytest.mark.skipif(fake_cuda_unavailable_reason() is not None, reason=f"fake CUDA unavailable: {fake_cuda_unavailable_reason()}")
@pytest.mark.parametrize(
    "mis",
    [dict(use_tis=True), dict(use_tis=True, use_rs=True, rs_level="token"),
     dict(use_tis=True, nonfinite_policy="error"), dict(use_tis=True, tis_batch_normalize=True)],
    ids=["sequence-stats", "token-rs", "nonfinite-error", "normalize-over-loss-mask"],
)
def test_drop_in_at_cp2_reads_once_per_call_flat_in_n(pool2, mis):
    # tis_batch_normalize over the loss mask: the drop-in makes two CP calls (the normalisation
    # statistics, then the engine), one read each
    calls = 2 if mis.get("tis_batch_normalize") else 1
    for n in (3, 40):  # N = 0 (nothing on the device, the lists are empty): tests/distributed/test_cp_mis.py
        for rank, found in enumerate(pool2.run(_cp_call, n, mis)):
            assert len(found) == calls and all("_read_status" in v for v in found), (
                f"N={n}, CP rank {rank}: expected exactly {calls} status read(s), got:\n" + "\n".join(found)
            )
