"""The vLLM rollout engine, for real: generation, an in-place weight update (the worker's ``reload_weights``
through ``collective_rpc``), token-for-token agreement with the HF engine's greedy output on the same weights; the
runtime's modes with vLLM rollout through the handoff (weights pushed per sync policy); and the quality and
sim-vs-real tables' ``engine=vllm`` option at toy size.

vllm is not in the project's .venv (vllm-cpu pins transformers < 5.20); run these with ``make test-vllm``, which
uses a separate environment (scripts/vllm_env.sh, docs/runtime.md). Without vllm they skip. One vLLM engine serves
the whole module (``RolloutEngines``): vLLM keeps process-wide state, and a second ``LLM`` in one process breaks
when the first is torn down.
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm not installed here: run `make test-vllm` (docs/runtime.md)")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from knittrans.runtime.engine import GroupRequest, SamplingConfig  # noqa: E402
from knittrans.runtime.hf_engine import HFRolloutEngine  # noqa: E402
from knittrans.runtime.vllm_engine import VLLMRolloutEngine  # noqa: E402
from baselines.admission import make_policy  # noqa: E402
from workloads.arith import ArithRLTask, ArithTask  # noqa: E402
from workloads.arith_session import ArithSetup, RolloutEngines  # noqa: E402
from workloads.tiny_models import (TinyPolicyConfig, WarmStartConfig, build_char_tokenizer, build_policy,  # noqa: E402
                                   encode_prompts, warm_start)

GREEDY = SamplingConfig(max_new_tokens=5, greedy=True)


@pytest.fixture(scope="module")
def engines():
    return RolloutEngines("vllm")


@pytest.fixture(scope="module")
def env(engines):
    tok = build_char_tokenizer()
    model = build_policy(TinyPolicyConfig(), tok, seed=0)
    warm_start(model, tok, ArithTask(), WarmStartConfig(steps=60))  # a policy whose greedy output is not constant
    engine = engines(ArithSetup(model, tok, ArithRLTask(ArithTask(), tok), seed=0))  # saved to a dir, then started
    assert isinstance(engine, VLLMRolloutEngine)
    probs = ArithTask().sample(3, 24)
    reqs = [GroupRequest(i, 0, tuple(x), (i,)) for i, x in enumerate(encode_prompts(tok, [p.prompt for p in probs]))]
    return tok, model, engine, reqs


def test_vllm_generates_with_behavior_logprobs_and_version(env):
    tok, _, engine, reqs = env
    grp = [GroupRequest(0, 0, reqs[0].prompt_ids, (10, 11, 12, 13))]
    out = engine.generate(grp, SamplingConfig(max_new_tokens=5), seed=1)
    assert sorted(s.traj_id for s in out) == [10, 11, 12, 13]
    for s in out:
        assert 1 <= len(s.response_ids) <= 5 and len(s.logprobs) == len(s.response_ids)
        assert all(lp <= 0.0 for lp in s.logprobs) and s.v_gen == engine.version == 0


def test_vllm_greedy_agrees_with_hf_engine_on_same_weights(env):
    tok, model, engine, reqs = env
    hf = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    a, b = engine.generate(reqs, GREEDY, seed=0), hf.generate(reqs, GREEDY, seed=0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-3)


def test_vllm_weight_update_takes_effect_and_records_version(env):
    tok, _, engine, reqs = env
    before = engine.generate(reqs, GREEDY, seed=0)
    other = build_policy(TinyPolicyConfig(), tok, seed=7)
    warm_start(other, tok, ArithTask(), WarmStartConfig(steps=30, seed=7))
    engine.load_weights(other.state_dict(), version=5)
    after = engine.generate(reqs, GREEDY, seed=0)
    assert engine.version == 5 and {s.v_gen for s in after} == {5}
    assert [s.logprobs for s in after] != [s.logprobs for s in before]
    ref = HFRolloutEngine(other, tok.eos_token_id, tok.pad_token_id).generate(reqs, GREEDY, seed=0)
    assert [s.response_ids for s in after] == [s.response_ids for s in ref]


def test_vllm_generates_from_a_fresh_thread_after_torch_set_num_threads(env):
    """The orchestrator calls the engine from its rollout thread while the tables run torch with 1 thread: a fresh
    thread's OpenMP count (one per core) then differs from torch's, which made vLLM's CPU attention abort the
    process (metadata for 2 threads, kernel with 1) until the engine aligned the calling thread."""
    import threading

    tok, _, engine, reqs = env
    before = torch.get_num_threads()
    fresh = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())  # a fresh thread's OpenMP count
    # torch's count made to differ from it (1 as in the tables, or 2 under OMP_NUM_THREADS=1); through the original:
    # vLLM replaced torch.set_num_threads with a no-op when it started
    torch._C.set_num_threads(2 if fresh == 1 else 1)
    out, errors = [], []

    def work() -> None:
        try:
            out.extend(engine.generate(reqs[:4], GREEDY, seed=0))
            engine.load_weights({k: v.clone() for k, v in env[1].state_dict().items()}, version=engine.version)
        except Exception as e:  # noqa: BLE001 - handed to the assertion below
            errors.append(e)

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "generation from a fresh thread hung"
    finally:
        torch._C.set_num_threads(before)
    assert not errors and len(out) == 4


class Recording:
    """Passes calls through to an engine and keeps every sample and every load's version; asserts the engine's
    version did not change during a generate call (in-flight requests finish with the weights they started with)."""

    def __init__(self, engine) -> None:
        self.engine, self.samples, self.loads = engine, [], []

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def stats(self):
        return self.engine.stats

    def generate(self, requests, sampling, seed):
        v0 = self.engine.version
        out = self.engine.generate(requests, sampling, seed)
        assert self.engine.version == v0, "weights changed under an in-flight wave"
        self.samples += out
        return out

    def load_weights(self, state_dict, version):
        self.loads.append(version)
        self.engine.load_weights(state_dict, version)


@torch.no_grad()
def teacher_forced_logprobs(model, weights, sample) -> list[float]:
    """Per-token log-probs of ``sample``'s response under ``weights`` (HF forward, temperature 1)."""
    model.load_state_dict(weights)
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(sample.prompt_ids)
    return [float(lp[p - 1 + i, t]) for i, t in enumerate(sample.response_ids)]


class LengthReward:
    """The arithmetic prompts with a dense reward (response length): samples of a group differ in reward, so every
    step has a nonzero advantage and moves the weights (the exact-match reward is all zeros for a weak policy)."""

    def __init__(self, task) -> None:
        self.task = task

    def batch(self, seed, batch_id, n):
        return self.task.batch(seed, batch_id, n)

    def reward(self, prompt, response_ids) -> float:
        return float(len(response_ids))


# (system, sync, k, M): weights reach vLLM after every step, every k-th step, or at the end of every batch.
MODES = [("knittrans", "every_step", 1, 2), ("train_batch", "every_batch", 1, 2), ("knittrans", "every_k", 2, 4),
         ("colocated", "every_step", 1, 2)]


@pytest.mark.parametrize("system,sync,k,M", MODES, ids=[f"{m[0]}-{m[1]}" for m in MODES])
def test_runtime_modes_push_weights_to_vllm_through_the_handoff(env, system, sync, k, M):
    """A real run of each mode with vLLM as the rollout engine, every trajectory through the handoff: the engine
    loads exactly the versions the sync policy publishes, and every sample was generated with the trainer's weights
    of its ``v_gen`` (vLLM's behavior log-probs equal the HF forward of that version's snapshot). A dense reward and
    a high learning rate move the weights every step, so a missed reload would show: the same check is shown to
    fail against the version-0 weights."""
    import copy
    import dataclasses

    from knittrans.runtime.config import RuntimeConfig
    from knittrans.runtime.engine import EngineStats
    from knittrans.runtime.trainer import GRPOConfig
    from workloads.arith_session import arith_setup, run_mode

    _, _, engine, _ = env
    engine.stats = EngineStats()
    rec = Recording(engine)
    setup = arith_setup(seed=1, warm=WarmStartConfig(steps=10), grpo=GRPOConfig(lr=1e-2))
    setup = dataclasses.replace(setup, task=LengthReward(setup.task))
    cfg = RuntimeConfig.for_system(system, num_batches=2, prompts_per_batch=4, group_size=2, num_minibatches=M,
                                   sync=sync, sync_every=k, inflight_groups=4, wave_groups=1, eval_every=1)
    run = run_mode(cfg, setup, engine=rec, make_policy=make_policy)
    total = cfg.total_steps
    assert [s.version for s in run.steps] == list(range(1, total + 1))
    assert all(0 <= t.staleness <= cfg.staleness_bound() for t in run.trajectories)
    # the loads: version 0 first, then increasing published versions, each one the sync policy allows
    assert rec.loads[0] == 0 and rec.loads == sorted(set(rec.loads)) and run.engine.weight_loads == len(rec.loads)
    every = {"every_step": 1, "every_k": k, "every_batch": M}[sync] if system != "colocated" else M
    assert all(v % every == 0 and v < total for v in rec.loads), rec.loads
    assert {s.v_gen for s in rec.samples} <= set(rec.loads) and len(rec.loads) > 1
    assert len(rec.samples) == cfg.num_batches * cfg.prompts_per_batch * cfg.group_size
    # every sample's behavior log-probs are those of the trainer's snapshot at its v_gen
    model = copy.deepcopy(setup.model).eval()
    later = [s for s in rec.samples if s.v_gen > 0]
    assert later, "no sample was generated after a weight push"
    for s in rec.samples:
        assert s.logprobs == pytest.approx(teacher_forced_logprobs(model, run.snapshots[s.v_gen], s), abs=2e-3)
    stale = max(max(abs(a - b) for a, b in zip(s.logprobs, teacher_forced_logprobs(model, run.snapshots[0], s)))
                for s in later)
    assert stale > 1e-2, f"the pushed weights barely differ from version 0 ({stale}): the check above is vacuous"


def test_quality_table_runs_with_vllm_rollout(engines, tmp_path):
    """``python -m repro.quality engine=vllm`` at toy size: every run of every arm gets the vLLM engine."""
    from repro.quality import QualityConfig, run_table
    from repro.spec.quality import ARMS, QualityRun

    cfg = QualityConfig(engine="vllm", seeds=[0, 1], num_batches=2, prompts_per_batch=4, group_size=2,
                        num_minibatches=2, warm_steps=5, eval_every=2, heldout=16, wave_groups=1, knittrans_budget=2,
                        out_dir=str(tmp_path / "quality"))
    before = engines.describe()
    results = run_table(cfg, engines)
    runs = [r for r in results.trials if isinstance(r, QualityRun)]
    assert sorted((r.seed, r.arm) for r in runs) == sorted((s, a) for s in (0, 1) for a in ARMS)
    assert all(r.steps == 4 and 0 <= r.auc <= 1 and r.staleness_max <= r.staleness_bound for r in runs)
    used = results.extra["rollout_engine"]
    assert used["engine"] == "vllm" and used["runs"] - before["runs"] == len(runs)
    # every group of every run was generated by vLLM: 2 batches x 4 groups, waves of one group
    assert used["generate_calls"] - before["generate_calls"] == len(runs) * 2 * 4
    assert used["weight_loads"] - before["weight_loads"] >= len(runs)


def test_simcheck_table_runs_with_vllm_rollout(engines, tmp_path):
    """``python -m repro.simcheck engine=vllm`` at toy size: calibrated on seed 0's runs, predicting seed 1's."""
    from repro.simcheck import SimCheckConf, run

    cfg = SimCheckConf(engine="vllm", out_dir=str(tmp_path / "simcheck"), logger="none", seeds=[0, 1],
                       calibrate_seeds=[0], calibrate_budgets=[2, 4], prompts_per_batch=4, group_size=2,
                       num_minibatches=2, num_batches=2, warm_steps=5, wave_groups=[1, 2], modes=["knittrans"],
                       budgets=[2, 4], syncs=["every_step"])
    before = engines.describe()
    summary = run(cfg, engines)
    rows = summary["rows"]
    assert len(rows) == 2 * 2 * 2 and {r["role"] for r in rows} == {"calibration", "heldout"}
    assert all(r["measured_mean"] >= 0 and r["sim_mean"] >= 0 for r in rows)
    used = summary["rollout_engine"]
    assert used["engine"] == "vllm" and used["runs"] - before["runs"] == len(rows)
    # 2 batches x 4 groups per run, in waves of 1 or 2 groups: 12 generate calls per seed and budget
    assert used["generate_calls"] - before["generate_calls"] == 2 * 2 * (8 + 4)
