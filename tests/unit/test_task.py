"""The synthetic digit task: tokenisation, answers, hand-computed rewards, reproducible sampling
and the chance level an untrained policy starts from."""

from __future__ import annotations

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.testbed.demo.task import BOS, DIGIT0, EOS, SEP, DigitTask, TaskConfig


def _tok(digits):
    return [DIGIT0 + d for d in digits]


@pytest.mark.parametrize(
    "kind, answer", [("copy", [3, 1, 4, 1]), ("reverse", [1, 4, 1, 3]), ("sort", [1, 1, 3, 4])]
)
def test_prompt_and_answer(kind, answer):
    task = DigitTask(TaskConfig(kind=kind))
    p = task.make_problem([3, 1, 4, 1])
    assert p.prompt.tolist() == [BOS] + _tok([3, 1, 4, 1]) + [SEP]
    assert p.answer.tolist() == _tok(answer)
    assert task.decode(p.prompt) == "<bos>3141<sep>"
    assert task.is_correct(p, _tok(answer))
    assert task.reward(p, _tok(answer)) == 1.0


def test_rewards_by_hand():
    task = DigitTask()
    p = task.make_problem([3, 1, 4, 1])
    assert task.reward(p, _tok([3, 1, 0, 0])) == 0.5
    assert task.reward(p, [30, 30, 30, 30]) == 0.0  # unused ids score nothing
    assert task.reward(p, _tok([3, 1, 4])) == 0.75  # a short response loses the missing positions
    assert task.reward(p, _tok([3, 1, 4, 1, 9])) == 1.0  # past the answer: ignored without <eos>
    assert not task.is_correct(p, _tok([3, 1, 4, 0]))
    assert task.rewards([p, p], [torch.tensor(_tok([3, 0, 0, 0])), torch.tensor(_tok([3, 1, 4, 1]))]).tolist() == [0.25, 1.0]


def test_rewards_with_eos():
    task = DigitTask(TaskConfig(min_length=2, max_length=4, stop_with_eos=True))
    assert task.eos_token_id == EOS and task.max_new_tokens == 5
    p = task.make_problem([5, 6, 7])
    assert task.reward(p, _tok([5, 6, 7]) + [EOS]) == 1.0 and task.is_correct(p, _tok([5, 6, 7]) + [EOS, 9])
    assert task.reward(p, _tok([5, 6, 7, 8, 9])) == 0.6  # no <eos>: 3 right of 5 answer tokens
    assert task.reward(p, _tok([5, 6]) + [EOS]) == pytest.approx(2 / 3)
    assert task.reward(p, _tok([5, 6, 7, 0]) + [EOS]) == 0.75
    assert not task.is_correct(p, _tok([5, 6, 7, 8]))


def test_sampling_is_reproducible_and_in_range():
    task = DigitTask(TaskConfig(min_length=2, max_length=5, num_symbols=7))
    a = task.sample(50, torch.Generator().manual_seed(3))
    b = task.sample(50, torch.Generator().manual_seed(3))
    assert [x.digits for x in a] == [x.digits for x in b]
    assert {len(x.digits) for x in a} == {2, 3, 4, 5}
    assert all(0 <= d < 7 for x in a for d in x.digits)


def test_uniform_policy_scores_one_over_vocab():
    """An untrained policy is close to uniform over the vocabulary: expected reward 1/V per
    position (low but nonzero), which is where GRPO starts."""
    task = DigitTask()
    g = torch.Generator().manual_seed(0)
    problems = task.sample(4000, g)
    responses = torch.randint(0, task.vocab_size, (4000, task.max_new_tokens), generator=g)
    mean = float(task.rewards(problems, list(responses)).mean())
    # 16000 Bernoulli(1/32) positions: standard error of the mean ~0.0014
    assert mean == pytest.approx(1 / 32, abs=0.006)


def test_bad_config_and_input():
    with pytest.raises(ConfigError) as e:
        TaskConfig(min_length=0, max_length=-1, num_symbols=40, vocab_size=32)
    for part in ("min_length=0", "max_length=-1", "vocab_size=32"):
        assert part in str(e.value)
    with pytest.raises(ConfigError, match="one of 'copy', 'reverse', 'sort'"):
        TaskConfig(kind="add")
    task = DigitTask()
    with pytest.raises(ValueError, match="got 2 digits"):
        task.make_problem([1, 2])
    with pytest.raises(ValueError, match="digits must lie in"):
        task.make_problem([1, 2, 3, 10])
    with pytest.raises(ValueError, match="num_problems=0"):
        task.sample(0)
