"""The multimodal counting task as an RL task: seeded prompts with images that fit their placeholders, an exact
reward, the cells layout (one shape per image token), and a warm start that learns."""

from __future__ import annotations

import pytest
import torch

from knittrans.mmdedup.gather import check_placeholders
from knittrans.runtime.engine import SamplingConfig
from knittrans.runtime.vlm_engine import VLMRolloutEngine
from workloads.mm_task import (MMCountingTask, MMTaskConfig, MMWarmStartConfig, supervised_batch,
                               teacher_forced_accuracy, warm_start)
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload
from workloads.vlm import TinyVLMConfig, build_tiny_vlm

TASK = MMCountingTask(MMTaskConfig())


def test_prompts_are_a_pure_function_of_seed_and_batch_and_fit_their_images():
    a, b = TASK.batch(3, 1, 4), TASK.batch(3, 1, 4)
    assert [p.prompt_ids for p in a] == [p.prompt_ids for p in b]
    assert all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p.images, q.images))
    assert [p.problem.shapes for p in a] != [p.problem.shapes for p in TASK.batch(3, 2, 4)]
    for p in a:
        check_placeholders(torch.tensor(p.prompt_ids), p.grids, TASK.vocab.image_pad_id, 2)
        assert p.request(0, 1, (0, 1)).images == p.images


def test_reward_is_one_exactly_for_the_count_followed_by_eos():
    p = TASK.batch(0, 0, 1)[0]
    right, eos = TASK.vocab.encode(p.problem.answer), TASK.vocab.eos_id
    wrong = TASK.vocab.encode(str(int(p.problem.answer) + 1))
    assert TASK.reward(p, tuple(right + [eos])) == 1.0
    assert TASK.reward(p, tuple(right + [eos] + wrong)) == 1.0  # what follows EOS is not read
    assert TASK.reward(p, tuple(right)) == 0.0  # never stopped
    assert TASK.reward(p, tuple(wrong + [eos])) == 0.0
    assert TASK.reward(p, (eos,)) == 0.0


def test_cells_layout_puts_each_shape_alone_in_its_own_image_token():
    wl = MultimodalWorkload(MMWorkloadConfig(image_sizes=((84, 112),), max_shapes=12, layout="cells", seed=1))
    for i in range(20):
        prob = wl.problem(i)
        (shapes,) = prob.shapes
        cells = {(s.cy // 28, s.cx // 28) for s in shapes}
        assert len(cells) == len(shapes) and all(c[0] < 3 and c[1] < 4 for c in cells)
        assert all(s.cx % 28 == 14 and s.cy % 28 == 14 and s.r <= 12 for s in shapes)
        target = prob.question.split()[2]
        assert prob.answer == str(sum(s.colour == target for s in shapes))


def test_the_random_layout_draws_what_it_drew_before_the_layout_switch():
    """Other tables' workloads (repro.transfer, repro.speedup) are unchanged by the new knobs: pinned spec."""
    prob = MultimodalWorkload(MMWorkloadConfig(seed=0)).problem(0)
    assert prob.question == "how many red shapes?" and prob.answer == "0"  # pinned at the commit before the knobs
    assert [(s.kind, s.colour, s.cx, s.cy, s.r) for s in prob.shapes[0]] == [("square", "yellow", 138, 117, 14)]


def test_warm_start_learns_the_answer_format_and_stops_at_its_target_accuracy():
    model = build_tiny_vlm(TinyVLMConfig(), TASK.vocab, seed=0)
    res = warm_start(model, TASK, MMWarmStartConfig(max_steps=12, batch_size=8, eval_every=4, eval_prompts=16,
                                                    target_accuracy=None))
    assert res.steps == 12 and sum(res.losses[-3:]) / 3 < res.losses[0] / 2
    assert [s for s, _ in res.accuracies] == [0, 4, 8, 12]
    # a target the policy already meets stops the warm start at its first evaluation, before any step
    assert res.accuracy > 0  # (deterministic: the answer prior already gets some right)
    again = warm_start(model, TASK, MMWarmStartConfig(max_steps=12, eval_every=4, eval_prompts=16,
                                                      target_accuracy=res.accuracy))
    assert again.steps == 0 and again.accuracy == res.accuracy


def test_teacher_forced_accuracy_is_greedy_decoding_accuracy():
    model = build_tiny_vlm(TinyVLMConfig(), TASK.vocab, seed=0)
    warm_start(model, TASK, MMWarmStartConfig(max_steps=20, batch_size=16, target_accuracy=None))
    prompts = TASK.heldout(32)
    eng = VLMRolloutEngine(model, eos_token_id=TASK.vocab.eos_id, pad_token_id=TASK.vocab.pad_id)
    out = eng.generate([p.request(i, 0, (i,)) for i, p in enumerate(prompts)],
                       SamplingConfig(max_new_tokens=3, greedy=True), seed=0)
    greedy = sum(TASK.reward(p, s.response_ids) for p, s in zip(prompts, out)) / len(prompts)
    assert teacher_forced_accuracy(model, supervised_batch(TASK, prompts)) == pytest.approx(greedy)
