"""Multimodal encoding deduplication: content keys, a refcounted encoding store, a dedup-aware fetch, and the
trainer path that encodes each distinct image once with intact gradients. See docs/mmdedup.md.

- ``keys``: ``EncodingKey`` (128-bit ``triton_kernels.encoding_hash`` digest + dtype + shape), ``content_keys``.
- ``store``: ``EncodingStore`` (key -> slots, refcounts, byte comparison on every hit), ``EncodingRef``.
- ``fetch``: ``EncodingPlane`` (a store per storage unit; ``fetch`` moves each distinct encoding once).
- ``gather``: ``collate`` / ``policy_logits(dedup=...)`` / ``grpo_loss`` (encoder once per distinct image,
  gathered into every occurrence; the undeduplicated twin behind the same switch).
- ``plane``: the multimodal data plane (``MMStorageUnit`` with an encoding store, ``MMController``, ``MMClient``,
  ``build_mm_inprocess``); ``plane_ray.build_mm_ray`` for the Ray transport (imported lazily: needs Ray).
"""

from knittrans.mmdedup.fetch import DistinctFetch, EncodingPlane, ImageOccurrence
from knittrans.mmdedup.gather import (BatchTokens, ImageSet, ImageTokenMismatchError, MMBatch, TrainSample,
                                      check_placeholders, collate, encode_distinct, grpo_loss, mrope_positions,
                                      policy_logits)
from knittrans.mmdedup.keys import EncodingInputError, EncodingKey, HashFn, content_keys, encoding_hash_fn
from knittrans.mmdedup.store import (EncodingConflictError, EncodingRef, EncodingStore, EncodingStoreError,
                                     StoreStats)

__all__ = [
    "BatchTokens", "DistinctFetch", "EncodingConflictError", "EncodingInputError", "EncodingKey", "EncodingPlane",
    "EncodingRef", "EncodingStore", "EncodingStoreError", "HashFn", "ImageOccurrence", "ImageSet",
    "ImageTokenMismatchError",
    "MMBatch", "StoreStats", "TrainSample", "check_placeholders", "collate", "content_keys", "encode_distinct",
    "encoding_hash_fn", "grpo_loss", "mrope_positions", "policy_logits",
]
