"""The "ab+c=" arithmetic task: a verifiable task a ~130K-parameter policy learns on one CPU core in minutes.

A prompt is a two-digit number plus a one-digit number and an equals sign (``"47+8="``); the answer is the sum in
decimal (``"55"``) followed by end-of-sequence. The reward is exact: 1.0 when the decoded response (up to EOS) is
the sum, else 0.0, so the learning curve has no reward-model noise. Prompts come from a seeded generator, and the
held-out set is drawn from a disjoint seed stream, so runs are reproducible and evaluation never leaks training
prompts by construction of the stream (the problem space is small, 900 problems, so the *problems* overlap; the
held-out score measures the policy, not memorization of a split).

Example::

    >>> task = ArithTask()
    >>> p = task.sample(seed=0, n=2)
    >>> [q.prompt for q in p]
    ['59+6=', '15+4=']
    >>> task.reward(p[0], "65"), task.reward(p[0], "64"), task.reward(p[0], "")
    (1.0, 0.0, 0.0)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from knittrans.runtime.trainer import RewardError, check_reward  # noqa: F401 - re-exported: the task's rewards

ARITH_ALPHABET = "0123456789+="
"""Every character a prompt or an answer can contain (the tokenizer's non-special vocabulary)."""


@dataclass(frozen=True, slots=True)
class ArithProblem:
    """One prompt and its exact answer."""

    prompt: str
    """The text the policy sees, e.g. ``"47+8="``."""
    answer: str
    """The exact expected response text before EOS, e.g. ``"55"``."""


@dataclass(frozen=True)
class ArithTask:
    """Two-digit plus one-digit addition with an exact-match reward."""

    min_a: int = 10
    """Smallest first operand (inclusive)."""
    max_a: int = 99
    """Largest first operand (inclusive)."""
    max_b: int = 9
    """Largest second operand (inclusive; the smallest is 0)."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_a <= self.max_a):
            raise ValueError(f"ArithTask: need 0 <= min_a <= max_a, got min_a={self.min_a} max_a={self.max_a}")
        if self.max_b < 0:
            raise ValueError(f"ArithTask.max_b must be >= 0, got {self.max_b}")

    @property
    def max_answer_len(self) -> int:
        """Characters in the longest answer (EOS not counted)."""
        return len(str(self.max_a + self.max_b))

    def problem(self, a: int, b: int) -> ArithProblem:
        return ArithProblem(prompt=f"{a}+{b}=", answer=str(a + b))

    def sample(self, seed: int, n: int) -> list[ArithProblem]:
        """``n`` problems drawn from a generator seeded with ``seed`` (same seed, same problems)."""
        rng = random.Random(seed)
        return [self.problem(rng.randint(self.min_a, self.max_a), rng.randint(0, self.max_b)) for _ in range(n)]

    def reward(self, problem: ArithProblem, response: str) -> float:
        """1.0 iff ``response`` (already cut at EOS) is exactly the answer."""
        return 1.0 if response == problem.answer else 0.0


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt as the runtime sees it: token ids (BOS first) and the problem its reward is checked against."""

    prompt_ids: tuple[int, ...]
    problem: ArithProblem


class ArithRLTask:
    """The arithmetic task over a tokenizer: seeded prompt batches and an exact reward on response token ids.

    Implements the runtime's ``RLTask`` protocol (``knittrans.runtime.protocols``)."""

    def __init__(self, task: ArithTask, tokenizer) -> None:
        self.task = task
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id

    def batch(self, seed: int, batch_id: int, n: int) -> list[TokenPrompt]:
        """The ``n`` prompts of batch ``batch_id`` in the run seeded ``seed`` (a pure function of both)."""
        probs = self.task.sample(seed * 1_000_003 + batch_id, n)
        return [TokenPrompt(tuple([self.tok.bos_token_id] + self.tok(p.prompt, add_special_tokens=False)["input_ids"]),
                            p) for p in probs]

    def response_text(self, response_ids: tuple[int, ...]) -> str:
        ids = list(response_ids)
        if self.eos in ids:
            ids = ids[:ids.index(self.eos)]
        return self.tok.decode(ids)

    def reward(self, prompt: TokenPrompt, response_ids: tuple[int, ...]) -> float:
        """Exact match on the text before EOS; a response that never emitted EOS scores 0 (it did not stop)."""
        if self.eos not in response_ids:
            return 0.0
        return self.task.reward(prompt.problem, self.response_text(response_ids))
