"""The long-tail task of the dose-response sweeps (issue 29): vocabulary >= 512 with distractors in
the prompt, responses of scratchpad + answer tokens, the answer scored after (or before) the
scratchpad; hand-derived rewards."""

from __future__ import annotations

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.testbed.demo.config import DemoConfig
from megatron_mis.testbed.demo.task import DIGIT0, SEP, BOS, DigitTask, TaskConfig


def _task(**kw) -> DigitTask:
    return DigitTask(TaskConfig(min_length=3, max_length=3, vocab_size=512, scratchpad=61, distractors=4, **kw))


def test_vocabulary_prompt_and_response_lengths():
    task = _task()
    assert task.vocab_size == 512 and task.max_new_tokens == 64  # 61 scratch + 3 answer
    problems = task.sample(200, generator=torch.Generator().manual_seed(0))
    for p in problems:
        assert p.prompt.numel() == 1 + 3 + 4 + 1 and p.prompt[0] == BOS and p.prompt[-1] == SEP
        extra = p.prompt[4:8]
        assert bool(((extra >= DIGIT0 + 10) & (extra < 512)).all())  # distractors: unused ids only
    seen = torch.cat([p.prompt[4:8] for p in problems])
    assert int(seen.max()) > 400 and int(seen.min()) < 60  # spread over the large vocabulary
    assert DigitTask(TaskConfig(vocab_size=512, scratchpad=253, max_length=3, min_length=3)).max_new_tokens == 256


def test_reward_reads_the_answer_after_the_scratchpad():
    task = _task()
    p = task.make_problem([3, 1, 4], [100, 200, 300, 400])
    scratch = [77] * 61
    assert task.reward(p, scratch + [DIGIT0 + 3, DIGIT0 + 1, DIGIT0 + 4]) == 1.0
    assert task.reward(p, scratch + [DIGIT0 + 3, 99, DIGIT0 + 4]) == pytest.approx(2 / 3)
    # the answer at the start (not after the scratchpad) scores nothing
    assert task.reward(p, [DIGIT0 + 3, DIGIT0 + 1, DIGIT0 + 4] + [77] * 61) == 0.0
    assert task.is_correct(p, scratch + [DIGIT0 + 3, DIGIT0 + 1, DIGIT0 + 4])
    after = _task(scratchpad_position="after")
    assert after.reward(p, [DIGIT0 + 3, DIGIT0 + 1, DIGIT0 + 4] + [77] * 61) == 1.0
    assert after.reward(p, scratch + [DIGIT0 + 3, DIGIT0 + 1, DIGIT0 + 4]) == 0.0


def test_bad_long_tail_settings_are_named():
    with pytest.raises(ConfigError) as e:
        TaskConfig(scratchpad=-1, distractors=-2, scratchpad_position="middle")
    for part in ("scratchpad=-1", "distractors=-2", "scratchpad_position='middle'"):
        assert part in str(e.value)
    with pytest.raises(ConfigError, match="need unused ids"):
        TaskConfig(vocab_size=14, distractors=2)
    with pytest.raises(ConfigError, match="scratchpad with stop_with_eos"):
        TaskConfig(scratchpad=4, stop_with_eos=True)
    with pytest.raises(ValueError, match="distractors must lie in"):
        _task().make_problem([1, 2, 3], [5, 200, 300, 400])  # 5 is a digit id
    with pytest.raises(ConfigError, match="scratchpad=2000"):
        DemoConfig(scratchpad=2000)


def test_digit_credit_hand_derived():
    task = _task(digit_credit=0.25)
    p = task.make_problem([3, 1, 4], [100, 200, 300, 400])
    scratch = [77] * 61
    # right, wrong digit (0.25), non-digit (0): (1 + 0.25 + 0) / 3
    assert task.reward(p, scratch + [DIGIT0 + 3, DIGIT0 + 9, 99]) == pytest.approx(1.25 / 3)
    assert task.reward(p, scratch + [DIGIT0 + 3, DIGIT0 + 1, DIGIT0 + 4]) == 1.0
    with pytest.raises(ConfigError, match="digit_credit=1.0"):
        TaskConfig(digit_credit=1.0)
