"""Runtime building blocks: tokenizer and tiny policy, arithmetic rewards, the HF engine, the GRPO trainer, and
the runtime config. Each test is named after the property it checks."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from knittrans.runtime.config import RuntimeConfig, RuntimeConfigError, SyncPolicy
from knittrans.runtime.engine import GenerationError, GroupRequest, Sample, SamplingConfig
from knittrans.runtime.hf_engine import HFRolloutEngine
from knittrans.runtime.rollouts import pack_rollouts, to_rollout
from knittrans.runtime.trainer import (GRPOConfig, GRPOTrainer, VarlenBatch, group_advantages, pack_available,
                                       pack_batch, pad_batch)
from workloads.arith import ArithRLTask, ArithTask, RewardError
from workloads.tiny_models import (ModelConfigError, TinyPolicyConfig, build_char_tokenizer, build_policy,
                                   check_tokenizer_matches, encode_prompts, save_policy)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_policy(TinyPolicyConfig(), tok, seed=0)


def _requests(tok, prompts, n):
    ids = encode_prompts(tok, prompts)
    return [GroupRequest(g, 0, tuple(x), tuple(range(g * n, g * n + n))) for g, x in enumerate(ids)]


# -- workloads ----------------------------------------------------------------------------------------------------

def test_saved_tokenizer_reloads_as_fast_tokenizer_with_same_ids(tok, model, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    save_policy(model, tok, tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(again, PreTrainedTokenizerFast)
    assert again("93+7=")["input_ids"] == tok("93+7=")["input_ids"]
    assert again.decode(tok("93+7=")["input_ids"]) == "93+7="
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)


def test_policy_size_is_in_issue_range(model, tok):
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n <= 1_000_000
    assert model.config.vocab_size == len(tok) == 15


@pytest.mark.parametrize("kwargs", [dict(hidden_size=66, num_heads=4), dict(num_layers=0), dict(hidden_size=-1),
                                    dict(hidden_size=24, num_heads=8)])
def test_invalid_model_config_is_rejected_naming_the_field(kwargs):
    with pytest.raises(ModelConfigError, match="TinyPolicyConfig"):
        TinyPolicyConfig(**kwargs)


def test_tokenizer_that_does_not_match_the_model_is_rejected(model):
    bigger = build_char_tokenizer("0123456789+=-*/abc")
    with pytest.raises(ModelConfigError, match="vocab_size"):
        check_tokenizer_matches(model, bigger)


def test_arith_reward_is_exact_and_requires_eos(tok):
    task = ArithRLTask(ArithTask(), tok)
    p = task.batch(seed=1, batch_id=0, n=1)[0]
    ans = tok(p.problem.answer, add_special_tokens=False)["input_ids"]
    assert task.reward(p, tuple(ans) + (tok.eos_token_id,)) == 1.0
    assert task.reward(p, tuple(ans)) == 0.0  # never stopped
    assert task.reward(p, tuple(ans) + (3, tok.eos_token_id)) == 0.0
    assert task.batch(1, 0, 4) == task.batch(1, 0, 4) != task.batch(1, 1, 4)


# -- HF engine ----------------------------------------------------------------------------------------------------

def test_behavior_logprobs_equal_teacher_forced_logprobs(tok, model):
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    out = eng.generate(_requests(tok, ["12+3=", "99+9="], 3), SamplingConfig(max_new_tokens=5), seed=0)
    assert len(out) == 6
    for s in out:
        full = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(model(full).logits[0, :-1], -1)
        P = len(s.prompt_ids)
        ref = [lp[P - 1 + j, t].item() for j, t in enumerate(s.response_ids)]
        assert s.logprobs == pytest.approx(ref, abs=1e-5)
        assert s.response_ids[-1] == tok.eos_token_id or len(s.response_ids) == 5


def test_greedy_output_does_not_depend_on_batch_companions(tok, model):
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    g = SamplingConfig(max_new_tokens=5, greedy=True)
    alone = eng.generate(_requests(tok, ["47+8="], 1), g, seed=0)[0]
    mixed = eng.generate(_requests(tok, ["47+8=", "10+0=", "5+5="], 1), g, seed=0)[0]
    assert alone.response_ids == mixed.response_ids


def test_load_weights_changes_output_and_records_version(tok, model):
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    g = SamplingConfig(max_new_tokens=5, greedy=True)
    reqs = _requests(tok, [f"{a}+{b}=" for a in range(10, 30) for b in (1, 7)], 1)
    before = [s.logprobs for s in eng.generate(reqs, g, seed=0)]
    other = build_policy(TinyPolicyConfig(), tok, seed=5)
    eng.load_weights(other.state_dict(), version=3)
    out = eng.generate(reqs, g, seed=0)
    assert eng.version == 3 and {s.v_gen for s in out} == {3}
    assert [s.logprobs for s in out] != before  # random-init greedy text may coincide; its log-probs do not
    assert [s.logprobs for s in out] == [s.logprobs for s in HFRolloutEngine(other, 2, 0).generate(reqs, g, seed=0)]


def test_empty_generation_is_a_clear_error():
    with pytest.raises(GenerationError, match="empty generation"):
        Sample(0, 0, 0, (1, 3), (), (), 0, 0.0, 0.0)


# -- trainer ------------------------------------------------------------------------------------------------------

def _items(tok, model, n_groups=3, n=4, seed=0):
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    out = eng.generate(_requests(tok, [f"{20 + g}+{g}=" for g in range(n_groups)], n),
                       SamplingConfig(max_new_tokens=5), seed=seed)
    items = []
    for g in range(n_groups):
        ss = [s for s in out if s.group_id == g]
        items += group_advantages(ss, [float(i % 2) for i in range(len(ss))])
    return items


def test_group_advantages_are_zero_mean_and_zero_for_identical_rewards(tok, model):
    items = _items(tok, model)
    for g in {i.sample.group_id for i in items}:
        adv = [i.advantage for i in items if i.sample.group_id == g]
        assert sum(adv) == pytest.approx(0.0, abs=1e-6) and max(adv) > 0
    same = [i.sample for i in items if i.sample.group_id == 0]
    assert all(i.advantage == 0.0 for i in group_advantages(same, [1.0] * len(same)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_a_clear_error(tok, model, bad):
    same = [i.sample for i in _items(tok, model) if i.sample.group_id == 0]
    with pytest.raises(RewardError, match="non-finite reward"):
        group_advantages(same, [0.0, bad] + [1.0] * (len(same) - 2))


def test_a_rewards_name_is_built_only_when_the_reward_is_bad():
    from knittrans.runtime.trainer import check_reward

    calls = []

    def where() -> str:
        calls.append(1)
        return "prompt 7 (two images)"

    assert check_reward(1, where) == 1.0 and not calls  # the per-trajectory path never formats its name
    with pytest.raises(RewardError, match=r"non-finite reward nan for prompt 7 \(two images\)"):
        check_reward(math.nan, where)
    assert calls == [1]
    with pytest.raises(RewardError, match="for trajectory 3"):
        check_reward(math.inf, "trajectory 3")


def test_first_step_is_on_policy_and_increments_version(tok, model):
    tr = GRPOTrainer(build_policy(TinyPolicyConfig(), tok, seed=0), GRPOConfig(kl_coef=0.1), tok.pad_token_id)
    share = pack_rollouts([to_rollout(it) for it in _items(tok, model)])
    res = tr.step(share)
    assert res.version == tr.version == 1
    assert res.clip_frac == 0.0 and res.mean_ratio == pytest.approx(1.0, abs=1e-4)
    assert res.kl == pytest.approx(0.0, abs=1e-6)
    res2 = tr.step(share)  # same data, moved policy: now off-policy by one step
    assert res2.version == 2 and res2.mean_ratio != pytest.approx(1.0, abs=1e-7)


@pytest.mark.skipif(not pack_available(), reason="triton_kernels.batched_pack not importable")
def test_packed_and_padded_layouts_give_the_same_token_logprobs(tok, model):
    vb = VarlenBatch.from_share(pack_rollouts([to_rollout(it) for it in _items(tok, model, n_groups=4, n=3, seed=1)]))
    pad, pack = pad_batch(vb, tok.pad_token_id), pack_batch(vb, tok.pad_token_id, row_tokens=24)
    assert pack.ids.shape[0] < pad.ids.shape[0]  # packing really put several sequences in a row
    with torch.no_grad():
        lp_pad = GRPOTrainer.token_logprobs(model, pad)[pad.resp]
        lp_pack = GRPOTrainer.token_logprobs(model, pack)[pack.resp]
    # same multiset of response-token log-probs (row order differs), to float tolerance
    assert torch.allclose(lp_pad.sort().values, lp_pack.sort().values, atol=1e-5)
    assert torch.allclose(pad.old_logprobs[pad.resp].sort().values, pack.old_logprobs[pack.resp].sort().values)


def test_share_fields_land_on_response_tokens_after_a_prompt_of_len_ids_minus_len_logprobs(tok, model):
    items = _items(tok, model, n_groups=2, n=2)
    vb = VarlenBatch.from_share(pack_rollouts([to_rollout(it) for it in items]))
    for i, it in enumerate(items):
        s = it.sample
        a, b = int(vb.cu_seqlens[i]), int(vb.cu_seqlens[i + 1])
        P = len(s.prompt_ids)
        assert vb.ids[a:b].tolist() == list(s.prompt_ids + s.response_ids)
        assert vb.loss_mask[a:b].tolist() == [False] * P + [True] * len(s.response_ids)
        assert vb.old_logprobs[a + P:b].tolist() == pytest.approx(list(s.logprobs))
        assert vb.advantages[a:b].tolist() == pytest.approx([0.0] * P + [it.advantage] * len(s.response_ids))
        assert vb.old_logprobs[a:a + P].abs().sum() == 0


def test_loss_mask_excludes_tokens_from_the_step():
    tok_ids = [1, 3, 4, 5, 2]
    s = Sample(0, 0, 0, (1, 3), (4, 5, 2), (-1.0, -1.0, -1.0), 0, 0.0, 0.0)
    r = to_rollout(group_advantages([s], [1.0])[0])
    masked = type(r)(r.traj, {**r.tensors, "loss_mask": np.array([True, False, False])})
    vb = VarlenBatch.from_share(pack_rollouts([masked]))
    assert vb.ids.tolist() == tok_ids and vb.loss_mask.tolist() == [False, False, True, False, False]
    assert pad_batch(vb, 0).resp.sum() == 1


# -- config -------------------------------------------------------------------------------------------------------

def test_budget_that_would_deadlock_train_batch_admission_is_rejected():
    with pytest.raises(RuntimeConfigError, match="deadlock"):
        RuntimeConfig.for_system("train_batch", prompts_per_batch=8, num_minibatches=4, inflight_groups=4)
    RuntimeConfig.for_system("knittrans", prompts_per_batch=8, num_minibatches=4, inflight_groups=4)  # fine


def test_staleness_bound_follows_budget_and_sync_lag():
    c = RuntimeConfig.for_system("knittrans", prompts_per_batch=8, num_minibatches=4, inflight_groups=4)
    assert c.staleness_bound() == 2
    c = RuntimeConfig.for_system("knittrans", prompts_per_batch=8, num_minibatches=4, inflight_groups=4,
                      sync=SyncPolicy.EVERY_BATCH)
    assert c.staleness_bound() == 2 + 3
    assert RuntimeConfig.for_system("colocated", num_minibatches=4).staleness_bound() == 3
    with pytest.raises(RuntimeConfigError, match="mode"):
        RuntimeConfig(admission="bogus")
