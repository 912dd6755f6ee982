"""A synthetic, verifiable task for the demo, generated at run time (no downloads).

The prompt is a short digit string between ``<bos>`` and ``<sep>``; the response must transform
it (default: copy it) and is scored by a program. A tiny GPT (vocabulary 32, hidden 64, 2 layers)
starts near chance (reward ~0.05) and reaches ~0.4-0.5 on the default copy task after 150 plain
GRPO steps of 16 prompts x 8 samples (about a minute on one CPU core; docs/demo_internals.md)::

    prompt    <bos> 3 1 4 1 <sep>
    response  3 1 4 1                 (copy; reverse: 1 4 1 3; sort: 1 1 3 4)
    reward    fraction of answer positions right: 4/4 = 1.0

Token ids: ``<pad>=0, <bos>=1, <eos>=2, <sep>=3``, digit ``d`` is ``4 + d``; the rest of the
vocabulary is unused (an untrained policy emits those ids too, and they score nothing). An
untrained model scores about ``1 / vocab_size`` per position (~0.03 with 32 ids).

With ``stop_with_eos`` the answer must also end with ``<eos>``: the answer is the part before the
first ``<eos>`` and the score is ``matches / max(length, answer length)``, so running on
costs reward. This makes response lengths vary (what the length-decay LR scheduler watches) but
learns more slowly.

With ``scratchpad = S`` (the long-tail task of the dose-response sweeps) the response is ``S`` free,
unscored tokens followed by the answer; with ``distractors = m`` the prompt carries ``m`` random
ids of the unused vocabulary after the digits. With a large vocabulary (>= 512) the free tokens
sample the policy's low-probability tail, where a numeric mismatch concentrates::

    prompt    <bos> 3 1 4 <417> <88> <sep>            (distractors 2)
    response  <301> <12> ... <77> 3 1 4             (scratchpad S, then the answer)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_mis.config.base import ConfigBase, doc
from megatron_mis.registry import Registry

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "SEP",
    "DIGIT0",
    "TASK_KINDS",
    "TaskConfig",
    "Problem",
    "DigitTask",
]

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4  # id of digit 0

#: How the answer digits follow from the prompt digits.
TASK_KINDS: Registry[Callable[[list[int]], list[int]]] = Registry("task kind")
TASK_KINDS.register("copy", lambda d: list(d))
TASK_KINDS.register("reverse", lambda d: list(reversed(d)))
TASK_KINDS.register("sort", lambda d: sorted(d))


@dataclass(kw_only=True, slots=True)
class TaskConfig(ConfigBase):
    """The synthetic digit task."""

    kind: Literal["copy", "reverse", "sort"] = doc("copy", "Answer = the prompt digits copied, reversed or sorted.")
    min_length: int = doc(4, "Fewest digits in a prompt.")
    max_length: int = doc(4, "Most digits in a prompt (responses get max_length tokens, +1 with stop_with_eos).")
    num_symbols: int = doc(10, "Digits used: 0 .. num_symbols-1.")
    vocab_size: int = doc(32, "Model vocabulary (4 special ids + the digits + unused ids).")
    stop_with_eos: bool = doc(False, "The answer must end with <eos>; a longer answer is penalised.")
    scratchpad: int = doc(
        0,
        "Free (unscored) response tokens before the answer: responses of scratchpad + max_length tokens whose "
        "low-probability tail over a large vocabulary is where a mismatch concentrates (0: the answer at once).",
    )
    scratchpad_position: Literal["before", "after"] = doc(
        "before",
        "before: the scratchpad precedes the answer (the answer's position moves with it); after: the answer "
        "comes first and the scratchpad follows it (unscored, as the tokens past the answer always are).",
    )
    digit_credit: float = doc(
        0.0,
        "Partial credit for a wrong digit at an answer position (0: none). With a large vocabulary an untrained "
        "policy rarely emits a digit; this credit gives GRPO a signal from the first steps.",
    )
    distractors: int = doc(
        0, "Random ids from the unused part of the vocabulary written into the prompt after the digits (before <sep>)."
    )

    def _check(self) -> list[str]:
        out = []
        if self.min_length < 1:
            out.append(f"min_length={self.min_length!r} must be >= 1")
        if self.max_length < self.min_length:
            out.append(f"max_length={self.max_length!r} must be >= min_length={self.min_length!r}")
        if self.num_symbols < 2:
            out.append(f"num_symbols={self.num_symbols!r} must be >= 2")
        if self.scratchpad_position not in ("before", "after"):
            out.append(f"scratchpad_position={self.scratchpad_position!r} must be 'before' or 'after'")
        if not 0.0 <= self.digit_credit < 1.0:
            out.append(f"digit_credit={self.digit_credit!r} must lie in [0, 1)")
        if self.scratchpad < 0:
            out.append(f"scratchpad={self.scratchpad!r} must be >= 0")
        if self.distractors < 0:
            out.append(f"distractors={self.distractors!r} must be >= 0")
        if self.scratchpad and self.stop_with_eos:
            out.append("scratchpad with stop_with_eos: the answer's position is fixed by the scratchpad (no <eos>)")
        if self.distractors and self.vocab_size <= DIGIT0 + self.num_symbols:
            out.append(
                f"distractors={self.distractors} need unused ids: vocab_size={self.vocab_size} must exceed "
                f"{DIGIT0 + self.num_symbols}"
            )
        if self.vocab_size < DIGIT0 + self.num_symbols:
            out.append(
                f"vocab_size={self.vocab_size!r} must hold the 4 special ids and num_symbols={self.num_symbols} "
                f"digits (>= {DIGIT0 + self.num_symbols})"
            )
        return out


@dataclass(frozen=True)
class Problem:
    """One task instance.

    Attributes:
        digits: the prompt digits (values ``0 .. num_symbols-1``).
        prompt: ``[L + 2]`` int64 tokens ``<bos> digits <sep>``.
        answer: ``[L]`` int64 token ids of the expected answer (without ``<eos>``).
    """

    digits: tuple[int, ...]
    prompt: torch.Tensor
    answer: torch.Tensor


class DigitTask:
    """Problems, tokenisation and the reward of :class:`TaskConfig`."""

    def __init__(self, config: TaskConfig | None = None) -> None:
        self.config = config or TaskConfig()
        self._target = TASK_KINDS.get(self.config.kind)

    @property
    def _offset(self) -> int:
        """Where the answer starts in a response."""
        return self.config.scratchpad if self.config.scratchpad_position == "before" else 0

    # ----------------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """The stop token the rollout engine should use (None without ``stop_with_eos``)."""
        return EOS if self.config.stop_with_eos else None

    @property
    def pad_token_id(self) -> int:
        return PAD

    @property
    def max_new_tokens(self) -> int:
        """Response budget: the scratchpad and the longest answer (+1 for ``<eos>``)."""
        return self.config.scratchpad + self.config.max_length + int(self.config.stop_with_eos)

    def decode(self, tokens: Sequence[int] | torch.Tensor) -> str:
        """Readable text: digits as characters, specials as ``<bos>`` etc., unused ids as
        ``<id>``."""
        names = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", SEP: "<sep>"}
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        out = []
        for t in ids:
            t = int(t)
            if t in names:
                out.append(names[t])
            elif DIGIT0 <= t < DIGIT0 + self.config.num_symbols:
                out.append(str(t - DIGIT0) if self.config.num_symbols <= 10 else f"[{t - DIGIT0}]")
            else:
                out.append(f"<{t}>")
        return "".join(out)

    def make_problem(self, digits: Sequence[int], distractors: Sequence[int] = ()) -> Problem:
        """The problem for given prompt digits (and, with ``distractors > 0``, that many unused
        ids written after them)."""
        d = [int(x) for x in digits]
        if not self.config.min_length <= len(d) <= self.config.max_length:
            raise ValueError(
                f"got {len(d)} digits; this task uses {self.config.min_length} .. {self.config.max_length}"
            )
        if any(not 0 <= x < self.config.num_symbols for x in d):
            raise ValueError(f"digits must lie in [0, {self.config.num_symbols}), got {d}")
        extra = [int(x) for x in distractors]
        if len(extra) != self.config.distractors:
            raise ValueError(f"got {len(extra)} distractors; this task uses {self.config.distractors}")
        if any(not DIGIT0 + self.config.num_symbols <= x < self.config.vocab_size for x in extra):
            raise ValueError(
                f"distractors must lie in [{DIGIT0 + self.config.num_symbols}, {self.config.vocab_size}), got {extra}"
            )
        prompt = torch.tensor([BOS] + [DIGIT0 + x for x in d] + extra + [SEP], dtype=torch.long)
        answer = torch.tensor([DIGIT0 + x for x in self._target(d)], dtype=torch.long)
        return Problem(digits=tuple(d), prompt=prompt, answer=answer)

    def sample(self, num_problems: int, generator: torch.Generator | None = None) -> list[Problem]:
        """``num_problems`` random problems (uniform length, uniform digits)."""
        if num_problems < 1:
            raise ValueError(f"num_problems={num_problems!r} must be >= 1")
        cfg = self.config
        lengths = torch.randint(cfg.min_length, cfg.max_length + 1, (num_problems,), generator=generator)
        out = []
        for n in lengths:
            digits = torch.randint(0, cfg.num_symbols, (int(n),), generator=generator).tolist()
            extra = (
                torch.randint(DIGIT0 + cfg.num_symbols, cfg.vocab_size, (cfg.distractors,), generator=generator).tolist()
                if cfg.distractors
                else []
            )
            out.append(self.make_problem(digits, extra))
        return out

    # --------------------------------------------------------------------------- reward
    def _answer_part(self, response: torch.Tensor) -> list[int]:
        ids = [int(t) for t in response.tolist()][self._offset :]
        if self.config.stop_with_eos and EOS in ids:
            return ids[: ids.index(EOS)]
        return ids

    def reward(self, problem: Problem, response: Sequence[int] | torch.Tensor) -> float:
        """Score in ``[0, 1]``: answer positions right (after the ``scratchpad`` free tokens; a wrong
        digit counts ``digit_credit``) / ``len(answer)`` (with
        ``stop_with_eos``: / ``max(len(answer), tokens before <eos>)``, the whole response when
        it has no ``<eos>``). Without ``stop_with_eos`` tokens past the answer length are
        ignored."""
        resp = torch.as_tensor(response, dtype=torch.long)
        got = self._answer_part(resp)
        want = problem.answer.tolist()
        matches = sum(1 for a, b in zip(got, want) if a == b)
        if self.config.digit_credit:
            digits = range(DIGIT0, DIGIT0 + self.config.num_symbols)
            matches += self.config.digit_credit * sum(1 for a, b in zip(got, want) if a != b and a in digits)
        if self.config.stop_with_eos:
            return matches / max(len(want), len(got))
        return matches / len(want)

    def is_correct(self, problem: Problem, response: Sequence[int] | torch.Tensor) -> bool:
        """Exactly the answer (and, with ``stop_with_eos``, an ``<eos>`` right after it)."""
        resp = torch.as_tensor(response, dtype=torch.long).tolist()[self._offset :]
        want = problem.answer.tolist()
        if self.config.stop_with_eos:
            return resp[: len(want) + 1] == want + [EOS]
        return resp[: len(want)] == want

    def rewards(self, problems: Sequence[Problem], responses: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[N]`` float32 rewards."""
        if len(problems) != len(responses):
            raise ValueError(f"got {len(problems)} problems and {len(responses)} responses")
        return torch.tensor([self.reward(p, r) for p, r in zip(problems, responses)], dtype=torch.float32)
