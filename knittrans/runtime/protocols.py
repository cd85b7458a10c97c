"""The three contracts the orchestrator runs on: a task, a rollout engine, a learner. Text and multimodal alike.

The orchestrator (``knittrans.runtime.orchestrator``) knows nothing of tokens, images or models beyond these:

- ``RLTask``: the prompt stream and the reward. A prompt carries ``prompt_ids``; a multimodal prompt also carries
  ``images`` (``pixel_values`` ``[patches, patch_dim]`` per image, placeholder order) and ``grids`` (their
  ``grid_thw``). The orchestrator copies them into the ``GroupRequest`` and, from there, into every ``Rollout``
  the handoff stores (each distinct image once when ``RuntimeConfig.multimodal``).
- ``RolloutEngine`` (``knittrans.runtime.engine``): ``generate(requests, sampling, seed) -> list[Sample]`` with
  the weights of one version at a time; ``load_weights(state_dict, version)`` is a sync point. ``HFRolloutEngine``
  and ``VLLMRolloutEngine`` implement it for text; a vision-language engine reads ``GroupRequest.images/grids``.
- ``Learner``: ``step(share)`` runs ONE optimizer step on this rank's packed share of an admitted mini-batch (a
  ``knittrans.dataplane.types.PackedShare``; multimodal: a ``knittrans.mmdedup.plane.MMShare``) and returns a
  ``StepResult``; ``version`` counts the steps applied; ``weights()`` is what a sync point sends to the engines.
  ``knittrans.runtime.trainer.GRPOTrainer`` implements it for text.

What a share holds (``TEXT_SCHEMA``; ``MM_SCHEMA`` adds ``image_index``): ``input_ids`` = prompt + response,
packed back to back (``share.fields["input_ids"].cu_seqlens``); ``old_logprobs``, ``advantages`` and
``loss_mask``, response-length each, packed the same way. A sequence's prompt is its first
``len(input_ids) - len(old_logprobs)`` ids. ``share.seq`` is the policy version the step trains at (``v_train``);
``share.group_ids`` every group of the mini-batch (what the step's completion releases from flow control).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from knittrans.runtime.engine import RolloutEngine

if TYPE_CHECKING:
    import torch

    from knittrans.dataplane.types import PackedShare


class Prompt(Protocol):
    """One prompt of a task. Multimodal prompts also have ``images`` and ``grids`` (read with ``getattr``: a text
    prompt need not define them)."""

    prompt_ids: Sequence[int]


class RLTask(Protocol):
    """Prompts and exact rewards (``workloads.arith.ArithRLTask`` is one)."""

    def batch(self, seed: int, batch_id: int, n: int) -> Sequence[Prompt]:
        """The ``n`` prompts of training batch ``batch_id`` of the run seeded ``seed`` (a pure function of both)."""

    def reward(self, prompt: Prompt, response_ids: tuple[int, ...]) -> float:
        """A finite reward for ``response_ids`` (EOS included when emitted) as the answer to ``prompt``."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    version: int
    """The version after this step (steps applied so far)."""
    loss: float
    clip_frac: float
    """Fraction of response tokens whose ratio was clipped (a direct measure of how off-policy the data was)."""
    mean_ratio: float
    kl: float
    tokens: int
    """Response tokens in the step (loss-masked ones)."""
    step_s: float
    """Wall time of forward + backward + optimizer step."""
    encoder_patches: int = 0
    """Image patches the vision encoder ran over in this step (multimodal learners; 0 for text). With encoding
    dedup: the patches of the share's distinct images."""
    occurrence_patches: int = 0
    """Image patches of every (sample, image) occurrence in the step: what an encoder without dedup runs over."""


@runtime_checkable
class Learner(Protocol):
    """One trainer rank's policy: steps on packed shares, counts versions, hands out its weights.

    Data parallel: each rank runs its own replica over its own share (``Handoff.consumer(rank)``) and the replicas
    all-reduce their gradients inside ``step``; the orchestrator runs one rank (see docs/runtime.md)."""

    version: int
    """Optimizer steps applied (``knittrans.types``: the policy version)."""

    def step(self, share: "PackedShare") -> StepResult:
        """One optimizer step on ``share``; increments ``version``."""

    def weights(self) -> "dict[str, torch.Tensor]":
        """A detached copy of the current weights (what a sync point sends to the rollout engines)."""


__all__ = ["Learner", "Prompt", "RLTask", "RolloutEngine", "StepResult"]
