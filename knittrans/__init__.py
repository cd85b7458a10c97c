"""KnitTrans: coordination of the rollout-to-trainer handoff in RL post-training."""
__version__ = "0.1.0"
