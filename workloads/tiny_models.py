"""Tiny policies and character tokenizers, built locally from configs (never downloaded).

The policy is a Llama-architecture ``transformers`` model with random init (~130K parameters at the defaults:
hidden 64, 2 layers, 2 heads of dim 32, tied embeddings), so the same checkpoint directory loads in the HF engine, the
trainer and vLLM. The tokenizer is a character vocabulary saved as a ``PreTrainedTokenizerFast`` (``tokenizer.json``
in the same directory), which vLLM loads too.

A mismatched tokenizer and model (a token id the embedding cannot look up) and an invalid model config are
rejected with errors that name the field, before any forward pass could fail obscurely.

Example::

    >>> tok = build_char_tokenizer()
    >>> tok.convert_ids_to_tokens(tok("47+8=")["input_ids"])
    ['4', '7', '+', '8', '=']
    >>> model = build_policy(TinyPolicyConfig(), tok, seed=0)
    >>> 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    True
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from workloads.arith import ARITH_ALPHABET, ArithProblem, ArithTask

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class ModelConfigError(ValueError):
    """An invalid tiny-policy config, or a tokenizer that does not match the model."""


@dataclass(frozen=True)
class TinyPolicyConfig:
    """A Llama-style causal LM small enough to train on one CPU core."""

    hidden_size: int = 64
    """Model width; must be a multiple of num_heads."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention heads (and key/value heads: no grouped-query attention at this size). 2 heads of 64 channels
    give head dim 32, the smallest that vLLM's CPU attention supports (16 is rejected at the first forward)."""
    intermediate_size: int = 256
    """MLP width."""
    max_positions: int = 64
    """Longest prompt + response in tokens the rotary embedding is configured for."""
    tie_embeddings: bool = True
    """Share input embedding and LM head (halves the parameters of a vocab-heavy tiny model)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_positions"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelConfigError(f"TinyPolicyConfig.{name} must be an int >= 1, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(f"TinyPolicyConfig: hidden_size={self.hidden_size} is not a multiple of "
                                   f"num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ModelConfigError(f"TinyPolicyConfig: head dim {self.hidden_size // self.num_heads} must be even "
                                   f"(rotary embeddings rotate pairs of channels)")


def build_char_tokenizer(alphabet: str = ARITH_ALPHABET):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet`` plus pad/bos/eos (ids 0, 1, 2).

    No special tokens are added on encode: callers put BOS in front of prompts themselves, so the HF engine, the
    trainer and vLLM (which receive token ids) all see the same sequence."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ModelConfigError(f"tokenizer alphabet must be non-empty with distinct characters, got {alphabet!r}")
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=PAD, padding_side="left")


def build_policy(cfg: TinyPolicyConfig, tokenizer, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` sized for ``tokenizer`` (float32, eval mode off)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                         max_position_embeddings=cfg.max_positions, tie_word_embeddings=cfg.tie_embeddings,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_cfg)
    check_tokenizer_matches(model, tokenizer)
    return model


def check_tokenizer_matches(model, tokenizer) -> None:
    """Raise ``ModelConfigError`` if ``tokenizer`` can emit ids the model's embedding cannot look up, or its
    special tokens disagree with the model config (a different tokenizer saved beside the checkpoint)."""
    vocab = model.config.vocab_size
    if len(tokenizer) > vocab:
        raise ModelConfigError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}: "
                               f"token ids >= {vocab} would index past the embedding; is this the model's tokenizer?")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        t, m = getattr(tokenizer, name), getattr(model.config, name, None)
        if t is None or (m is not None and t != m):
            raise ModelConfigError(f"tokenizer {name}={t} but the model config has {name}={m}; the tokenizer does "
                                   f"not match the model")


def save_policy(model, tokenizer, path: str | Path) -> Path:
    """Save model and tokenizer to one directory that the HF engine, the trainer and vLLM all load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def encode_prompts(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt with BOS in front (no padding)."""
    if not prompts:
        return []
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]  # one batched call (Rust), not one each
    return [[tokenizer.bos_token_id] + x for x in ids]


# -- supervised warm start ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmStartConfig:
    """A short supervised warm start so GRPO starts from a policy with nonzero reward (a random 130K model
    almost never hits the exact sum, and an all-zero group has no GRPO signal)."""

    steps: int = 60
    """Optimizer steps on teacher-forced (prompt, answer) pairs."""
    batch_size: int = 64
    """Problems per step."""
    lr: float = 3e-3
    """Adam learning rate."""
    seed: int = 0
    """Problem stream seed (shifted away from the RL prompt seeds)."""


def warm_start(model, tokenizer, task: ArithTask, cfg: WarmStartConfig) -> None:
    """Train ``model`` in place with cross-entropy on the answer tokens (prompt tokens are not scored)."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = random.Random(10_000_019 + cfg.seed)
    model.train()
    for _ in range(cfg.steps):
        probs = task.sample(rng.randrange(1 << 30), cfg.batch_size)
        ids, labels, mask = _supervised_batch(tokenizer, probs)
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


def _supervised_batch(tokenizer, probs: Sequence[ArithProblem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, labels, attention mask); labels are -100 except on answer tokens and EOS."""
    prompts = encode_prompts(tokenizer, [p.prompt for p in probs])
    answers = [a + [tokenizer.eos_token_id]
               for a in tokenizer([p.answer for p in probs], add_special_tokens=False)["input_ids"]]
    width = max(len(a) + len(b) for a, b in zip(prompts, answers))
    ids = torch.full((len(probs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return ids, labels, mask


def clone_policy(model):
    """An independent copy (the rollout engine's replica, the KL reference)."""
    return copy.deepcopy(model)
