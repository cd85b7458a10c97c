"""The rollout-engine interface: typed requests and results, and the protocol every engine implements.

An engine holds one copy of the policy weights at a time, tagged with its policy version (``v``, optimizer steps
applied; see ``knittrans.types``). ``generate`` runs a set of GRPO groups to completion with the weights loaded
when the call started: weights change only between calls (``load_weights``), so in-flight requests always finish
with the version they started with and each sample's ``v_gen`` is exact. Both engines (``HFRolloutEngine``, the
CPU default, and ``VLLMRolloutEngine``) return per-token behavior log-probabilities, which the GRPO trainer's
importance ratios are taken against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

import torch


class GenerationError(RuntimeError):
    """An engine returned something the trainer cannot use (an empty response, mismatched log-probs)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled."""

    max_new_tokens: int = 5
    """Response length cap in tokens, EOS included (the batch constraints' max_response_len)."""
    temperature: float = 1.0
    """Softmax temperature; behavior log-probs are taken at this temperature."""
    greedy: bool = False
    """Argmax decoding (evaluation, engine-agreement tests); log-probs are still those of the T=1 softmax."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature!r}")


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to be sampled ``len(traj_ids)`` times (its GRPO group)."""

    group_id: int
    batch_id: int
    prompt_ids: tuple[int, ...]
    traj_ids: tuple[int, ...]
    images: tuple[torch.Tensor, ...] = ()
    """Multimodal prompts: the ``pixel_values`` ``[patches, patch_dim]`` of each image, in placeholder order (a
    vision-language engine encodes them; the handoff stores each distinct one once)."""
    grids: tuple[tuple[int, int, int], ...] = ()
    """``grid_thw`` of each image in ``images``."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"GroupRequest {self.group_id}: empty prompt")
        if not self.traj_ids:
            raise ValueError(f"GroupRequest {self.group_id}: no samples requested")
        if len(self.images) != len(self.grids):
            raise ValueError(f"GroupRequest {self.group_id}: {len(self.images)} images but {len(self.grids)} grids")


@dataclass(frozen=True)
class Sample:
    """One generated response with what the trainer needs to learn from it."""

    traj_id: int
    group_id: int
    batch_id: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    """Generated tokens, EOS included when the model emitted it."""
    logprobs: tuple[float, ...]
    """Behavior log-probability of each response token under the generating weights."""
    v_gen: int
    """Policy version loaded in the engine when the sample started generating."""
    t_start: float
    t_end: float

    def __post_init__(self) -> None:
        if len(self.response_ids) == 0:
            raise GenerationError(f"trajectory {self.traj_id} (group {self.group_id}): empty generation; an engine "
                                  f"must return at least one token (EOS counts)")
        if len(self.logprobs) != len(self.response_ids):
            raise GenerationError(f"trajectory {self.traj_id}: {len(self.logprobs)} log-probs for "
                                  f"{len(self.response_ids)} response tokens")


@dataclass
class EngineStats:
    """Counters an engine keeps, for the runtime's time model (decode time per token, sync cost)."""

    generate_calls: int = 0
    generated_tokens: int = 0
    generate_s: float = 0.0
    weight_loads: int = 0
    load_s: float = 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates GRPO groups with the weights of one policy version at a time."""

    @property
    def version(self) -> int:
        """The policy version currently loaded."""

    stats: EngineStats

    def generate(self, requests: Sequence[GroupRequest], sampling: SamplingConfig, seed: int) -> list[Sample]:
        """All samples of ``requests``, generated with the currently loaded version."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights (a sync point) and record ``version``."""
