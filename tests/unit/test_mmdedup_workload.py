"""Multimodal workload: Qwen2-VL preprocessing without torchvision, placeholders, exact rewards, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workloads.multimodal import (ImageInputError, MMWorkloadConfig, MultimodalWorkload, check_placeholders,
                                  draw_image, mm_token_type_ids, preprocess_image, reward)
from workloads.vlm import TinyVLMConfig, VLMVocab


@pytest.fixture(scope="module")
def wl():
    return MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=6, n=4, images_per_prompt=2,
                                               image_sizes=((56, 84), (84, 56), (112, 112))))


def test_preprocessing_matches_transformers_pil_processor(wl):
    proc_mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    proc = proc_mod.Qwen2VLImageProcessorPil()
    img = draw_image(wl.problem(0).shapes[0], 84, 140)
    for im in (img, img.resize((150, 101))):  # exact sides, and a resize through smart_resize
        ref = proc(images=[im], return_tensors="pt")
        mine = preprocess_image(im)
        assert tuple(ref["image_grid_thw"][0].tolist()) == mine.grid_thw
        assert torch.equal(ref["pixel_values"], mine.pixel_values)


def test_paper_size_image_is_1024_patches_of_1176():
    x = preprocess_image(np.zeros((448, 448, 3), np.uint8))
    assert x.pixel_values.shape == (1024, 1176) and x.grid_thw == (1, 32, 32) and x.num_tokens == 256


def test_groups_repeat_the_prompt_images_and_rewards_are_exact(wl):
    groups = wl.sample_batch(0)
    sizes = {g.images[0].grid_thw for g in groups}
    assert len(sizes) > 1  # sizes vary across prompts
    for g in groups:
        assert len(g.samples) == 4
        for s in g.samples:
            check_placeholders(s.token_ids, g.images, wl.vocab)
            tt = mm_token_type_ids(s.token_ids, wl.vocab)
            assert int(tt.sum()) == sum(im.num_tokens for im in g.images)
            resp = s.token_ids[s.loss_mask].tolist()
            assert s.reward == reward(wl.vocab, resp, g.problem.answer)
            colour = g.problem.question.split()[2]
            truth = sum(sh.colour == colour for shapes in g.problem.shapes for sh in shapes)
            assert g.problem.answer == str(truth)
    assert wl.sample_batch(0)[0].samples[0].token_ids.tolist() == groups[0].samples[0].token_ids.tolist()


def test_reward_is_exact_match_after_the_last_period():
    v = VLMVocab()
    assert reward(v, v.encode("abc. 3") + [v.eos_id], "3") == 1.0
    assert reward(v, v.encode("abc. 31"), "3") == 0.0
    assert reward(v, v.encode("3. 4"), "3") == 0.0


@pytest.mark.parametrize("bad, msg", [
    (np.zeros((56, 56, 4), np.uint8), "3 RGB channels"),
    (np.zeros((56, 56), np.uint8), "3 RGB channels"),
    (np.zeros((0, 56, 3), np.uint8), "zero size"),
    (np.zeros((56, 56, 3), np.float32), "dtype float32"),
    ("not an image", "PIL image or a numpy array"),
])
def test_bad_images_are_rejected_by_name(bad, msg):
    with pytest.raises(ImageInputError, match=msg):
        preprocess_image(bad)


def test_non_rgb_pil_image_is_rejected():
    from PIL import Image

    with pytest.raises(ImageInputError, match="mode 'RGBA'"):
        preprocess_image(Image.new("RGBA", (56, 56)))


def test_image_token_count_must_match_the_grid(wl):
    g = wl.group(0, 0)
    ids = g.samples[0].token_ids
    pad = int((ids == wl.vocab.image_pad_id).nonzero()[0])
    short = torch.cat([ids[:pad], ids[pad + 1:]])  # one placeholder fewer than the first image's grid
    with pytest.raises(ImageInputError, match="do not match"):
        check_placeholders(short, g.images, wl.vocab)


def test_vocab_rejects_unknown_characters():
    with pytest.raises(ValueError, match="not in the vocabulary"):
        VLMVocab().encode("RED")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="mrope_section"):
        TinyVLMConfig(mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="n must be"):
        MMWorkloadConfig(n=0)
