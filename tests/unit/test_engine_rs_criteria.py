"""Divergence rejection criteria (``rs_criteria``, issue 32 item 1): verl's ``rollout_rs`` family
(``token_k1/k2/k3``, ``seq_sum_k1/k2/k3``, ``seq_mean_k1/k2/k3``, ``seq_max_k2/k3``).

Tiers: hand-derived values; the k1 criteria equal the ratio band of their level; the naive
per-token reference (tests/unit/mis_reference.py); config errors (every problem at once, the bad
value and the allowed set); fuzzed bad ``rs_criteria`` values give a clear ``ConfigError`` and
nothing else; the length bias of a fixed geometric band against the k3 criteria (measured).
CP = 2 / 4 on gloo: tests/distributed/test_cp_rs_criteria.py; host synchronisation:
tests/fakecuda/test_rs_criteria_paths.py.
"""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.config.base import ConfigError
from megatron_mis.config.mis import RS_CRITERIA
from megatron_mis.core.engine import compute_mis, compute_mis_from_lists
from megatron_mis.presets import preset_path

from mis_reference import reference_mis

# ----------------------------------------------------------------------- hand-derived values
#: log r per token. A: a small symmetric wobble; B: one spike of 0.5 in ten tokens; C: a steady
#: drift of -0.02 over twenty tokens.
LOG_R = {
    "A": [0.1, -0.1, 0.0],
    "B": [0.5] + [0.0] * 9,
    "C": [-0.02] * 20,
}
# k2 = x^2 / 2, k3 = e^x - 1 - x, by hand:
#   A: k2 = .005, .005, 0 (sum .01, mean .00333, max .005); k3 = .0051709, .0048374, 0
#      (sum .0100083, mean .0033361, max .0051709); prod r = 1, geometric r = 1
#   B: k2 = .125 (sum .125, mean .0125, max .125); k3 = e^.5 - 1.5 = .1487213 (mean .0148721);
#      prod r = e^.5 = 1.6487, geometric r = e^.05 = 1.0513
#   C: k2 = .0002 each (sum .004, mean .0002, max .0002); k3 = e^-.02 - .98 = .000198013 each
#      (sum .0039603); prod r = e^-.4 = .6703, geometric r = e^-.02 = .9802
HAND = [
    # (criteria, sequences rejected whole, tokens rejected alone (sequence, index), fraction per criterion)
    ({"seq_mean_k3": 0.005}, {"B"}, set(), {"seq_mean_k3": 1 / 3}),
    ({"seq_max_k3": 0.1}, {"B"}, set(), {"seq_max_k3": 1 / 3}),
    ({"seq_max_k3": 0.005}, {"A", "B"}, set(), {"seq_max_k3": 2 / 3}),
    ({"seq_sum_k3": 0.005}, {"A", "B"}, set(), {"seq_sum_k3": 2 / 3}),
    ({"seq_mean_k2": 0.01}, {"B"}, set(), {"seq_mean_k2": 1 / 3}),
    ({"seq_sum_k2": 0.009}, {"A", "B"}, set(), {"seq_sum_k2": 2 / 3}),
    ({"seq_max_k2": 0.004}, {"A", "B"}, set(), {"seq_max_k2": 2 / 3}),
    ({"seq_mean_k1": [0.99, 1.01]}, {"B", "C"}, set(), {"seq_mean_k1": 2 / 3}),
    ({"seq_sum_k1": [0.9, 1.1]}, {"B", "C"}, set(), {"seq_sum_k1": 2 / 3}),
    ({"seq_sum_k1": 1.1}, {"B", "C"}, set(), {"seq_sum_k1": 2 / 3}),  # one number U: [1/U, U]
    ({"token_k2": 0.1}, set(), {("B", 0)}, {"token_k2": 1 / 33}),
    ({"token_k3": 0.005}, set(), {("A", 0), ("B", 0)}, {"token_k3": 2 / 33}),
    ({"token_k1": [0.95, 1.05]}, set(), {("A", 0), ("A", 1), ("B", 0)}, {"token_k1": 3 / 33}),
    # combined: every criterion must pass; each criterion's fraction is its own
    ({"seq_mean_k3": 0.005, "token_k1": [0.95, 1.05]}, {"B"}, {("A", 0), ("A", 1)},
     {"seq_mean_k3": 1 / 3, "token_k1": 3 / 33}),
    ({"seq_mean_k3": 0.005, "seq_max_k3": 0.005, "seq_mean_k1": [0.99, 1.01]}, {"A", "B", "C"}, set(),
     {"seq_mean_k3": 1 / 3, "seq_max_k3": 2 / 3, "seq_mean_k1": 2 / 3}),
    # seq_zscore_k1 {k3: K, z: Z}: reject |mean log r + K| > Z sqrt(2 K / n), by hand:
    #   K = 1e-4, Z = 3: A |1e-4| vs 3 sqrt(2e-4 / 3) = .0245 keep; B |.0501| vs .0134 and
    #   C |-.0199| vs .0095 out
    ({"seq_zscore_k1": {"k3": 1e-4, "z": 3}}, {"B", "C"}, set(), {"seq_zscore_k1": 2 / 3}),
    ({"seq_zscore_k1": 1e-4}, {"B", "C"}, set(), {"seq_zscore_k1": 2 / 3}),  # one number: K, Z = 3
    #   K = .01, Z = .5: the band is centred on -K: C |-.02 + .01| = .01 vs .0158 stays (|-.02|
    #   would not), B |.06| vs .0224 out, A |.01| vs .0408 stays
    ({"seq_zscore_k1": {"k3": 0.01, "z": 0.5}}, {"B"}, set(), {"seq_zscore_k1": 1 / 3}),
    #   k3: batch: K = the mean k3 of the 33 tokens = (.0100083 + .1487213 + .0039603) / 33 = .0049304;
    #   Z = 1: A .0049 vs .0573, C .0151 vs .0222 stay, B .0549 vs .0314 out; Z = 3 keeps all
    ({"seq_zscore_k1": {"k3": "batch", "z": 1}}, {"B"}, set(), {"seq_zscore_k1": 1 / 3}),
    ({"seq_zscore_k1": {"k3": "batch"}}, set(), set(), {"seq_zscore_k1": 0.0}),
]


def _hand_batch():
    train, rollout, masks = [], [], []
    for xs in LOG_R.values():
        b = torch.full((len(xs),), -2.0, dtype=torch.float64)
        train.append((b + torch.tensor(xs, dtype=torch.float64)).float())
        rollout.append(b.float())
        masks.append(torch.ones(len(xs), dtype=torch.int64))
    return train, rollout, masks


@pytest.mark.parametrize("criteria, seqs_out, toks_out, fractions", HAND, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_hand_derived_rejections(criteria, seqs_out, toks_out, fractions):
    train, rollout, masks = _hand_batch()
    res = compute_mis_from_lists(train, rollout, masks, MISConfig(use_rs=True, rs_criteria=criteria))
    keep = res.split(res.keep_mask, [len(x) for x in LOG_R.values()])
    for name, k in zip(LOG_R, keep):
        expected = [not (name in seqs_out or (name, i) in toks_out) for i in range(len(LOG_R[name]))]
        assert k.tolist() == expected, (name, criteria)
    assert res.seq_rejected.tolist() == [name in seqs_out for name in LOG_R]
    summary = res.scalars()
    for name, value in fractions.items():
        assert summary[f"mis_rs_{name}_fraction"] == pytest.approx(value, abs=1e-12), name
    # sequence criteria report per sequence, token criteria per token (the metric layout hosts reduce)
    for name in criteria:
        metric = res.token_metrics[f"mis_rs_{name}_fraction"]
        if name.startswith("seq_"):
            per_seq = res.split(metric, [len(x) for x in LOG_R.values()])
            assert [float(p[0]) for p in per_seq] == [float(res.seq_rejected[i] and _fails_alone(name, criteria[name], s)) for i, s in enumerate(LOG_R)]
    # the ratio band is not applied with rs_criteria: no band metrics
    assert "mis_rs_mask_fraction_low" not in summary


def _fails_alone(name, threshold, seq):
    res = compute_mis_from_lists(*_hand_batch(), MISConfig(use_rs=True, rs_criteria={name: threshold}))
    return bool(res.seq_rejected[list(LOG_R).index(seq)])


@pytest.mark.parametrize("level, criterion", [("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")])
@pytest.mark.parametrize("band", [(0.9, 1.12), (0.95, 1.3), (0.999, 1.001)])
def test_k1_criterion_is_the_ratio_band_of_its_level(level, criterion, band):
    g = torch.Generator().manual_seed(5)
    lengths = [1, 4, 9, 16, 25, 36, 0, 3]
    train = [-torch.rand(n, generator=g) for n in lengths]
    rollout = [a + torch.randn(n, generator=g) * 0.15 for a, n in zip(train, lengths)]
    masks = [(torch.rand(n, generator=g) > 0.1).long() for n in lengths]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = compute_mis_from_lists(train, rollout, masks, MISConfig(use_tis=True, use_rs=True, rs_criteria={criterion: list(band)}))
        b = compute_mis_from_lists(train, rollout, masks, MISConfig(use_tis=True, use_rs=True, rs_level=level, rs_lower_bound=band[0], rs_upper_bound=band[1]))
    assert torch.equal(a.keep_mask, b.keep_mask) and torch.equal(a.weights, b.weights)
    sa, sb = a.scalars(), b.scalars()
    assert sa[f"mis_rs_{criterion}_fraction"] == pytest.approx(sb["mis_rs_mask_fraction_low"] + sb["mis_rs_mask_fraction_high"])
    assert a.keep_mask.sum() < sum(int(m.sum()) for m in masks)  # the band acts: not a vacuous comparison


# --------------------------------------------------------------- equivalence with the reference
CRITERIA_SETS = [
    {"seq_mean_k3": 0.005},
    {"seq_max_k3": 0.05},
    {"seq_sum_k3": 0.05},
    {"seq_mean_k2": 0.004, "seq_max_k2": 0.06},
    {"seq_sum_k2": 0.05, "seq_sum_k1": [0.7, 1.3]},
    {"seq_mean_k1": [0.97, 1.02]},
    {"token_k1": [0.7, 1.4], "seq_mean_k3": 0.01},
    {"token_k2": 0.05, "token_k3": 0.04},
    {"seq_zscore_k1": {"k3": 0.004, "z": 2.0}},
    {"seq_zscore_k1": {"k3": "batch", "z": 1.0}, "token_k3": 0.04},
    {**{name: (1.3 if name.endswith("k1") else 0.02) for name in RS_CRITERIA.names()},  # all twelve at once
     "seq_zscore_k1": {"k3": "batch", "z": 2.5}},
]


def _random_lists(seed, nonfinite):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 1, 30, 9, 0, 12, 64, 2, 40]
    scales = [0.02, 0.3, 0.05, 0.1, 0.4, 0.1, 0.03, 0.2, 0.08, 0.15]  # the mismatch differs per sequence
    train, rollout, masks = [], [], []
    for n, scale in zip(lengths, scales):
        a = -torch.rand(n, generator=g) * 2
        b = a + torch.randn(n, generator=g) * scale
        if nonfinite and n > 3:
            a[1] = float("nan")
            b[2] = float("inf")
        train.append(a)
        rollout.append(b)
        masks.append((torch.rand(n, generator=g) > 0.2).long())
    return train, rollout, masks


@pytest.mark.parametrize("criteria", CRITERIA_SETS, ids=lambda c: ",".join(c))
@pytest.mark.parametrize("extra", [
    {}, dict(use_tis=True, tis_batch_normalize=True), dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25),
    dict(use_tis=True, tis_mode="icepop", tis_lower_bound=0.6, tis_upper_bound=1.6, rs_veto_threshold=0.3),
    dict(nonfinite_policy="reject", mis_metrics="full"),
], ids=["rs_only", "token_tis_bn", "geo_mask", "icepop_veto", "reject_full"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_matches_reference(criteria, extra, nonfinite):
    train, rollout, masks = _random_lists(7, nonfinite)
    cfg = MISConfig(use_rs=True, rs_criteria=criteria, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compute_mis_from_lists(train, rollout, masks, cfg)
        summary = res.scalars()
    ref = reference_mis(train, rollout, masks, cfg)
    assert res.keep_mask.tolist() == sum(ref["keep"], [])
    torch.testing.assert_close(res.weights, torch.tensor(sum(ref["weights"], [])), rtol=1e-6, atol=1e-7)
    for name, value in ref["metrics"].items():
        assert summary[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for name in criteria:
        assert f"mis_rs_{name}_fraction" in ref["metrics"]


def test_reference_test_is_not_vacuous():
    """The reference cases reject something under every criterion set and keep something."""
    train, rollout, masks = _random_lists(7, False)
    for criteria in CRITERIA_SETS:
        res = compute_mis_from_lists(train, rollout, masks, MISConfig(use_rs=True, rs_criteria=criteria))
        summary = res.scalars()
        assert 0 < summary["num_kept_tokens"] < summary["num_loss_tokens"], criteria


def test_weights_only_path_rejects_the_same():
    train, rollout, masks = _random_lists(9, True)
    criteria = {**{name: (1.3 if name.endswith("k1") else 0.02) for name in RS_CRITERIA.names()}, "seq_zscore_k1": {"k3": "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = compute_mis_from_lists(train, rollout, masks, MISConfig(use_rs=True, rs_criteria=criteria))
        b = compute_mis_from_lists(train, rollout, masks, MISConfig(use_rs=True, rs_criteria=criteria, mis_metrics="none"))
    assert torch.equal(a.keep_mask, b.keep_mask) and torch.equal(a.weights, b.weights)


# ------------------------------------------------------------------------------------ config
def test_config_errors_all_at_once_with_value_and_allowed_set():
    with pytest.raises(ConfigError) as info:
        MISConfig(use_rs=True, rs_lower_bound=0.9, rs_criteria={
            "seq_mean_kl3": 0.005, "seq_max_k1": 2.0, "seq_mean_k3": -1.0, "token_k1": [1.2, 0.8], "seq_sum_k1": 0.5,
            "token_k2": [0.1, 0.2], "seq_max_k3": "lots",
        })
    problems = info.value.problems
    text = "\n".join(problems)
    assert "unknown rejection criterion 'seq_mean_kl3' (did you mean 'seq_mean_k3'?); valid: seq_max_k2" in text
    assert "unknown rejection criterion 'seq_max_k1'" in text and "token_k3" in text  # the allowed set
    assert "seq_mean_k3=-1.0 must be one positive finite number" in text
    assert "token_k1=[1.2, 0.8] must be a ratio band [lower, upper] with 0 < lower < upper" in text
    assert "seq_sum_k1=0.5 must be a ratio band" in text and "one number U > 1" in text
    assert "token_k2=[0.1, 0.2] must be one positive finite number" in text
    assert "seq_max_k3='lots' must be one positive finite number" in text
    # every criterion problem is reported (the band clash is reported once the criteria are valid)
    assert len(problems) == 7, problems


def test_zscore_threshold_forms_and_errors(tmp_path):
    """seq_zscore_k1 takes {k3: K, z: Z} (Z defaults to 3), one number K, or k3: batch; every bad
    form is an error naming the value and the allowed forms, all reported at once."""
    bound = lambda value: MISConfig(use_rs=True, rs_criteria={"seq_zscore_k1": value}).rs_bounds()[0]  # noqa: E731
    assert tuple(bound({"k3": 1e-3, "z": 2})) == ("seq_zscore_k1", 1e-3, 2.0)
    assert tuple(bound({"k3": 1e-3})) == ("seq_zscore_k1", 1e-3, 3.0)
    assert tuple(bound(2e-3)) == ("seq_zscore_k1", 2e-3, 3.0)
    assert tuple(bound({"k3": "batch", "z": 4})) == ("seq_zscore_k1", 0.0, 4.0)
    path = tmp_path / "mis.yaml"
    path.write_text("use_rs: true\nrs_criteria: {seq_zscore_k1: {k3: 5e-4, z: 2.5}}\n")  # 5e-4: a string to PyYAML
    assert tuple(MISConfig.from_yaml(path).rs_bounds()[0]) == ("seq_zscore_k1", 5e-4, 2.5)
    cases = [
        ({"k3": 0}, "must be {k3: K, z: Z} with K > 0"), ({"k3": -1e-3}, "must be {k3: K, z: Z}"),
        ({"z": 3}, "has no k3"), ({"k3": 1e-3, "zz": 2}, "unknown key(s) zz"), ({"k3": "bach"}, "or 'batch'"),
        ({"k3": 1e-3, "z": 0}, "Z > 0"), ({"k3": 1e-3, "z": float("nan")}, "Z > 0"), ([0.99, 1.01], "or one number K > 0"),
        ("lots", "must be {k3: K, z: Z}"), (None, "must be {k3: K, z: Z}"), ({"k3": 1e4}, "at most 1000"),
    ]
    for value, needle in cases:
        with pytest.raises(ConfigError) as info:
            MISConfig(use_rs=True, rs_criteria={"seq_zscore_k1": value})
        assert f"seq_zscore_k1={value!r:.80}" in str(info.value) and needle in str(info.value), (value, str(info.value))
    with pytest.raises(ConfigError) as info:  # with other bad criteria: every problem at once
        MISConfig(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": 0}, "seq_mean_k3": -1})
    assert len(info.value.problems) == 2


def test_zscore_batch_k3_counts_valid_tokens_only():
    """k3: batch is the mean k3 over VALID tokens: a neutralised non-finite loss token is not in it.
    By hand: X = log r [0.2, 0.2] + two NaN tokens, Y = four tokens of log r 0. k3 of 0.2 is
    e^0.2 - 1.2 = 0.0214028, so K = 0.0428055 / 6 = 0.0071343 (over the 8 loss tokens it would be
    0.0053507). X's mean log r is 0.2 over its 2 valid tokens: |0.2 + K| / sqrt(2 K / 2) = 2.452
    (2.807 with the loss-token K), so z = 2.6 keeps X and z = 2.3 rejects it; Y (|K| / sqrt(K / 2)
    = 0.119) stays."""
    train = [torch.tensor([-1.0 + 0.2, -1.0 + 0.2, float("nan"), float("nan")]), torch.full((4,), -1.0)]
    rollout = [torch.full((4,), -1.0), torch.full((4,), -1.0)]
    masks = [torch.ones(4, dtype=torch.int64)] * 2
    for z, rejected in ((2.6, [False, False]), (2.3, [True, False])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the NaN tokens' warning
            res = compute_mis_from_lists(train, rollout, masks, MISConfig(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": "batch", "z": z}}))
        assert res.seq_rejected.tolist() == rejected, z


def test_zscore_batch_k3_with_a_global_kept_normaliser_is_an_error():
    """The global normaliser decides over the whole step's sequences at once: a K3 measured per
    call would keep other sequences there than in the loss's calls."""
    base = dict(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="global", use_rs=True)
    with pytest.raises(ConfigError, match="seq_zscore_k1 with k3: batch measures K3 per call"):
        MISConfig(**base, tis_batch_normalize_over="kept", rs_criteria={"seq_zscore_k1": {"k3": "batch"}})
    MISConfig(**base, tis_batch_normalize_over="kept", rs_criteria={"seq_zscore_k1": {"k3": 1e-3}})  # a fixed K3: fine
    MISConfig(**base, tis_batch_normalize_over="loss_mask", rs_criteria={"seq_zscore_k1": {"k3": "batch"}})  # nothing rejected there


def test_band_keys_with_criteria_are_an_error_not_silently_ignored():
    with pytest.raises(ConfigError, match=r"rs_lower_bound=0.9, rs_level='geometric' set together with rs_criteria"):
        MISConfig(use_rs=True, rs_level="geometric", rs_lower_bound=0.9, rs_criteria={"seq_mean_k3": 0.005})


@pytest.mark.parametrize("value", [[1, 2], "seq_mean_k3", 0.005, None])
def test_rs_criteria_must_be_a_mapping(value):
    with pytest.raises(ConfigError, match=r"rs_criteria=.* must be a mapping \{criterion: threshold\}"):
        MISConfig(use_rs=True, rs_criteria=value)


def test_criteria_without_use_rs_warn_and_do_nothing():
    with pytest.warns(UserWarning, match=r"rs_criteria=\{'seq_mean_k3': 0.005\} has no effect because use_rs is false"):
        cfg = MISConfig(rs_criteria={"seq_mean_k3": 0.005})
    assert cfg.rs_bounds() == () and not cfg.rejects


def test_yaml_thresholds_and_resolved_bounds(tmp_path):
    path = tmp_path / "mis.yaml"
    # PyYAML reads 5e-3 as a string: accepted as the number it spells
    path.write_text("use_rs: true\nrs_criteria: {seq_mean_k3: 5e-3, token_k1: 2, seq_mean_k1: [0.99, 1.001]}\n")
    cfg = MISConfig.from_yaml(path)
    assert [tuple(b) for b in cfg.rs_bounds()] == [("seq_mean_k3", 0.0, 0.005), ("token_k1", 0.5, 2.0), ("seq_mean_k1", 0.99, 1.001)]
    assert cfg.token_rejects and cfg.rejects  # token_k1 rejects single tokens: the CP bit exchange runs
    assert not MISConfig(use_rs=True, rs_criteria={"seq_max_k3": 1.0}).token_rejects


def test_registry_holds_every_criterion_once():
    assert RS_CRITERIA.names() == sorted([
        "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
        "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "seq_zscore_k1",
    ])
    assert RS_CRITERIA.get("seq_max_k3").reduce == "max" and RS_CRITERIA.get("token_k1").is_band
    assert RS_CRITERIA.get("seq_zscore_k1").reduce == "zscore" and not RS_CRITERIA.get("seq_zscore_k1").is_band
    with pytest.raises(ValueError, match="already registered"):
        RS_CRITERIA.register("seq_max_k3", RS_CRITERIA.get("seq_max_k3"))


_BAD_VALUES = [0, -1, 0.0, float("nan"), float("inf"), "-3", "nan", True, None, [], [1.0], [1, 2, 3], [2.0, 1.0],
               [0.0, 1.0], ["a", 1], {"x": 1}, 1e39, [1e-40, 2.0], object()]


def test_fuzzed_bad_criteria_give_a_clear_config_error():
    """Random mappings of (possibly misspelt) names to bad values: always a ConfigError naming
    rs_criteria and each bad entry; never another exception, never accepted."""
    rnd = random.Random(1234)
    names = RS_CRITERIA.names()
    for _ in range(300):
        data = {}
        for _ in range(rnd.randint(1, 4)):
            name = rnd.choice(names)
            if rnd.random() < 0.3:  # a typo
                i = rnd.randrange(len(name))
                name = name[:i] + rnd.choice("xk_19") + name[i + 1:]
            value = rnd.choice(_BAD_VALUES)
            if name in RS_CRITERIA and not name.endswith("k1") and value in ([1, 2],):
                continue
            data[name] = value
        bad = [n for n, v in data.items() if n not in RS_CRITERIA or not _valid(n, v)]
        if not bad:
            continue
        with pytest.raises(ConfigError) as info:
            MISConfig(use_rs=True, rs_criteria=data)
        text = str(info.value)
        for n in bad:
            assert repr(n) in text or f"{n}=" in text, (n, data, text)


def _valid(name, value):
    try:
        MISConfig(use_rs=True, rs_criteria={name: value})
        return True
    except ConfigError:
        return False


# ----------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name, criteria", [("seq_mean_k3", {"seq_mean_k3": 0.005}),
                                            ("k3_rs_token_tis", {"seq_mean_k3": 0.005, "token_k3": 0.5}),
                                            ("zscore_rs_token_mis", {"seq_zscore_k1": {"k3": "batch", "z": 3}})])
def test_presets(name, criteria):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = MISConfig.from_yaml(preset_path(name))
    assert cfg.use_rs and dict(cfg.rs_criteria) == criteria


# ------------------------------------------------------------------------------ length bias
def _rejected_fraction(cfg, length, num, seed):
    """Sequences of ``length`` tokens with log r ~ N(-s^2/2, s^2), s^2 = 2e-3 (K3 ~ 1e-3, the
    mismatch of an MoE model): the fraction of sequences rejected."""
    g = torch.Generator().manual_seed(seed)
    var = 2e-3
    log_r = torch.randn(num * length, generator=g, dtype=torch.float64) * math.sqrt(var) - var / 2
    rollout = torch.full((num * length,), -1.0)
    train = (rollout.double() + log_r).float()
    res = compute_mis(train, rollout, torch.ones(num * length, dtype=torch.bool), list(range(0, num * length + 1, length)), cfg)
    return float(res.seq_rejected.double().mean())


def test_fixed_geometric_band_is_length_biased_and_k3_mean_is_not():
    """The spread of a sequence's mean log r is about sqrt(2 K3 / T): a fixed geometric band drops
    short answers first; the mean of k3 (>= 0, centred on K3 whatever T) at 5 K3 drops neither;
    the max of k3 grows with T, so seq_max_k3 drops LONG answers first at a tight bound."""
    geo = MISConfig(use_rs=True, rs_level="geometric", rs_lower_bound=0.99, rs_upper_bound=1.001)
    mean_k3 = MISConfig(use_rs=True, rs_criteria={"seq_mean_k3": 0.005})
    max_k3 = MISConfig(use_rs=True, rs_criteria={"seq_max_k3": 0.005})
    short, long_ = (50, 4000), (1000, 200)
    g_short, g_long = _rejected_fraction(geo, *short, 1), _rejected_fraction(geo, *long_, 2)
    m_short, m_long = _rejected_fraction(mean_k3, *short, 1), _rejected_fraction(mean_k3, *long_, 2)
    x_short, x_long = _rejected_fraction(max_k3, *short, 1), _rejected_fraction(max_k3, *long_, 2)
    # mean log r ~ N(-1e-3, 2e-3 / T), rejected outside [log .99, log 1.001]: 0.452 at T = 50,
    # 0.079 at T = 1000 (normal CDF below); within 4 binomial standard errors
    for t, num, got in ((50, 4000, g_short), (1000, 200, g_long)):
        sd = math.sqrt(2e-3 / t)
        cdf = lambda x: 0.5 * (1 + math.erf((x + 1e-3) / (sd * math.sqrt(2))))  # noqa: E731
        p = 1 - cdf(math.log(1.001)) + cdf(math.log(0.99))
        assert got == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / num)), (t, got, p)
    assert g_short > 5 * g_long
    # mean k3 ~ K3 chi2_T / T with K3 = 1e-3: P(mean > 5 K3) = P(chi2_50 > 250) ~ 0, at either length
    assert m_short == 0.0 and m_long == 0.0
    # P(k3_t > .005) = P(|log r + 1e-3| >~ .1): 2.5% per token; 1 - .975^T: 0.72 at 50, 1.0 at 1000
    assert 0.6 < x_short < 0.85 and x_long == 1.0


@pytest.mark.parametrize("criterion, threshold", [("seq_mean_k3", 0.005), ("seq_mean_k2", 0.0045), ("seq_mean_k1", [0.99, 1.07])])
def test_sequence_means_count_the_valid_tokens(criterion, threshold):
    """A neutralised (NaN) token is not in a sequence's mean, as at the geometric level: log r =
    0.1, 0.1 and a NaN token gives mean k3 = 0.0051709 over the 2 valid tokens (0.0034473 over
    all 3), mean k2 = 0.005 (0.00333), geometric ratio e^0.1 = 1.105 (e^0.0667 = 1.069 over 3)."""
    train = torch.tensor([-1.9, -1.9, float("nan"), -2.0])
    rollout = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compute_mis(train, rollout, torch.ones(4, dtype=torch.bool), [0, 3, 4], MISConfig(use_rs=True, rs_criteria={criterion: threshold}))
    assert res.seq_rejected.tolist() == [True, False]


def test_zscore_band_rejects_the_same_share_at_every_length():
    """seq_zscore_k1 is the geometric band scaled to the length: with log r ~ N(-1e-3, 2e-3) per
    token (K3 = e^(mu + var / 2) - 1 - mu = 1e-3 exactly) the mean log r of T tokens is
    N(-1e-3, 2e-3 / T), so {k3: 1e-3, z: 2} rejects P(|Z| > 2) = 0.0455 at T = 50 and at T = 1000
    alike (a fixed band: 0.45 and 0.08, above), and k3: batch measures K3 ~ 1e-3 and does the same."""
    p = math.erfc(2 / math.sqrt(2))
    for cfg in (MISConfig(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": 1e-3, "z": 2}}),
                MISConfig(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": "batch", "z": 2}})):
        for t, num, seed in ((50, 4000, 1), (1000, 1000, 2)):
            got = _rejected_fraction(cfg, t, num, seed)
            assert got == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / num)), (cfg.rs_criteria, t, got, p)
    # centring matters at long T: the mean's offset -K3 is sqrt(K3 T / 2) = 0.71 SD at T = 1000, so
    # a band centred on 0 rejects P(|Z + .71| > 2) = 0.101 there, 2.2x the centred band's share
    sd = math.sqrt(2e-3 / 1000)
    uncentred = MISConfig(use_rs=True, rs_level="geometric", rs_lower_bound=math.exp(-2 * sd), rs_upper_bound=math.exp(2 * sd))
    got = _rejected_fraction(uncentred, 1000, 1000, 2)
    q = 0.5 * math.erfc((2 - 1e-3 / sd) / math.sqrt(2)) + 0.5 * math.erfc((2 + 1e-3 / sd) / math.sqrt(2))
    assert got == pytest.approx(q, abs=4 * math.sqrt(q * (1 - q) / 1000)) and got > 1.8 * p
