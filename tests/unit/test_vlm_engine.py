"""The vision-language rollout engine: exact behaviour log-probs, deterministic greedy decoding, versions, and the
vision tower run once per distinct image of a call.

Tolerance: behaviour log-probs equal a teacher-forced forward of the same weights within 1e-4 absolute (fp32;
the engine's left-padded KV-cache layout and the trainer's right-padded full forward sum in different orders;
observed ~1e-6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from knittrans.mmdedup.gather import ImageSet, TrainSample, collate
from knittrans.mmdedup.keys import EncodingInputError
from knittrans.runtime.engine import GroupRequest, RolloutEngine, SamplingConfig
from knittrans.runtime.vlm_engine import VLMRolloutEngine, distinct_images
from knittrans.runtime.vlm_learner import token_logprobs
from workloads.mm_task import MMCountingTask, MMTaskConfig
from workloads.vlm import TinyVLMConfig, build_tiny_vlm, vision_tower

TASK = MMCountingTask(MMTaskConfig(image_sizes=((56, 56), (56, 84), (84, 84)), images_per_prompt=2))


@pytest.fixture(scope="module")
def model():
    return build_tiny_vlm(TinyVLMConfig(), TASK.vocab, seed=0)


def engine(model) -> VLMRolloutEngine:
    return VLMRolloutEngine(model, eos_token_id=TASK.vocab.eos_id, pad_token_id=TASK.vocab.pad_id)


def requests(n_groups: int = 3, group_size: int = 3, batch_id: int = 0) -> list[GroupRequest]:
    prompts = TASK.batch(seed=0, batch_id=batch_id, n=n_groups)
    return [p.request(g, batch_id, tuple(range(g * group_size, (g + 1) * group_size))) for g, p in enumerate(prompts)]


def teacher_forced(model, reqs, samples) -> list[torch.Tensor]:
    """Each sample's response log-probs from one right-padded forward over prompt + response (the trainer's)."""
    by_group = {r.group_id: r for r in reqs}
    pixels, grids, rows = [], [], []
    for s in samples:
        r = by_group[s.group_id]
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(s.prompt_ids):] = True
        rows.append(TrainSample(s.traj_id, ids, mask, 0.0, tuple(range(len(pixels), len(pixels) + len(r.images)))))
        pixels += r.images
        grids += r.grids
    batch = collate(rows, ImageSet(tuple(pixels), tuple(grids)), TASK.tokens)
    with torch.no_grad():
        lp = token_logprobs(model.eval(), batch, dedup=True)
    return [lp[b][batch.loss_mask[b, 1:]] for b in range(len(samples))]


def test_behaviour_logprobs_equal_a_teacher_forced_forward_of_the_same_weights(model):
    eng = engine(model)
    reqs = requests()
    out = eng.generate(reqs, SamplingConfig(max_new_tokens=4), seed=1)
    assert isinstance(eng, RolloutEngine)
    assert [s.traj_id for s in out] == [t for r in reqs for t in r.traj_ids]
    assert len({s.response_ids for s in out}) > 1  # sampled, not all the same
    for s, ref in zip(out, teacher_forced(eng.model, reqs, out)):
        assert ref.shape[0] == len(s.logprobs)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_decoding_is_deterministic_and_independent_of_the_rest_of_the_batch(model):
    eng = engine(model)
    greedy = SamplingConfig(max_new_tokens=4, greedy=True)
    reqs = requests()
    a = eng.generate(reqs, greedy, seed=0)
    b = eng.generate(reqs, greedy, seed=123)
    alone = eng.generate(reqs[1:2], greedy, seed=7)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a if s.group_id == 1] == [s.response_ids for s in alone]
    for x, y in zip([s for s in a if s.group_id == 1], alone):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    # sampling is a pure function of the seed
    s1 = eng.generate(reqs, SamplingConfig(max_new_tokens=4), seed=5)
    s2 = eng.generate(reqs, SamplingConfig(max_new_tokens=4), seed=5)
    assert [s.response_ids for s in s1] == [s.response_ids for s in s2]


def test_loading_weights_bumps_the_version_that_samples_carry_and_changes_the_policy(model):
    eng = engine(model)
    reqs = requests(n_groups=2)
    before = eng.generate(reqs, SamplingConfig(max_new_tokens=3), seed=0)
    assert eng.version == 0 and {s.v_gen for s in before} == {0}
    w = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    eng.load_weights(w, version=3)
    after = eng.generate(reqs, SamplingConfig(max_new_tokens=3), seed=0)
    assert eng.version == 3 and {s.v_gen for s in after} == {3} and eng.stats.weight_loads == 1
    assert [s.logprobs for s in before] != [s.logprobs for s in after]
    assert all(torch.equal(eng.model.state_dict()[k], w[k]) for k in w)
    assert not torch.equal(model.state_dict()["lm_head.weight"], w["lm_head.weight"])  # a private replica


def test_the_vision_tower_runs_once_per_distinct_image_of_a_call(model):
    eng = engine(model)
    reqs = requests(n_groups=3, group_size=4)
    # a fourth group shows group 0's images again (another prompt, the same pictures): still encoded once
    reqs.append(dataclasses.replace(reqs[0], group_id=3, traj_ids=(12, 13, 14, 15)))
    seen: list[int] = []
    hook = vision_tower(eng.model).register_forward_hook(lambda m, args, out: seen.append(int(args[0].shape[0])))
    try:
        eng.generate(reqs, SamplingConfig(max_new_tokens=2), seed=0)
    finally:
        hook.remove()
    distinct = distinct_images(reqs)
    assert len(distinct.pixels) == 6 and distinct.ids[3] == distinct.ids[0]
    assert seen == [sum(x.shape[0] for x in distinct.pixels)]
    assert eng.stats.encoded_patches == seen[0]
    assert eng.stats.occurrence_patches == sum(x.shape[0] for r in reqs for x in r.images) * 4
    assert eng.stats.image_occurrences == 4 * 4 * 2 and eng.stats.distinct_images == 6


def test_prompts_whose_placeholders_do_not_fit_their_images_are_rejected_before_generation(model):
    eng = engine(model)
    r = requests(n_groups=1)[0]
    with pytest.raises(EncodingInputError, match="do not match"):
        eng.generate([dataclasses.replace(r, images=r.images[:1], grids=r.grids[:1])], SamplingConfig(), seed=0)
    with pytest.raises(EncodingInputError, match="uint8|dtype"):
        eng.generate([dataclasses.replace(r, images=tuple(x.to(torch.uint8) for x in r.images))], SamplingConfig(),
                     seed=0)
    assert eng.stats.generate_calls == 0
