"""`claw demo`: Claw end to end, training agents.

Phase 1 (:mod:`.apex`): Ape-X-style DQN on CartPole-v1, actor processes (:mod:`.actors`)
recording through ``RecordSteps``, the learner (:mod:`.dqn`) popping prioritized 3-step
batches and publishing its weights through Redis (:mod:`.weights`). Phase 2 (:mod:`.ppo`):
a few on-policy PPO rollouts through a ``rollout`` recipe, each formed by the workers from
its policy version's steps and served once. Phase 3 (:mod:`.offload`): pixel observations
(:mod:`.pixels`) augmented by the prefetch workers, timed against augmenting in the
training loop. Then :mod:`.report`. Torch and matplotlib
are imported only when the demo runs (the ``demo`` extra).
"""

from orchestrator.cli.demo.run import DemoConfig, run

__all__ = ["DemoConfig", "run"]
