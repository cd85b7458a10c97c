"""KnitTrans: coordination of the rollout-to-trainer handoff in RL post-training.

``knittrans.Handoff`` is the whole handoff (admission, data plane, dedup, versions) behind one config; see
``knittrans.handoff``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing knittrans stays light (no torch) until the handoff is used
    if name in ("Handoff", "HandoffConfig", "Rollout", "Transport"):
        from knittrans import handoff

        return getattr(handoff, name)
    raise AttributeError(f"module 'knittrans' has no attribute {name!r}")
