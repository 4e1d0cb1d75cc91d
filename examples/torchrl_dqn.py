"""DQN on CartPole with a TorchRL training loop whose replay buffer is Claw.

TorchRL's own parts everywhere (``GymEnv``, ``Collector``, ``QValueActor``, ``DQNLoss``,
``HardUpdate``, ``TensorDictReplayBuffer``) except the buffer's storage and sampler:
``ClawStorage`` ingests what the collector gathers, Claw's prefetch workers draw prioritized
batches, and the loss's TD errors go back to Claw as priorities
(``rb.update_tensordict_priority``). Hyperparameters are rl-zoo's DQN CartPole ones
(lr 2.3e-3, batch 64, learning starts 1000, 128 gradient steps per 256 frames, target
refreshed once per round, net [256, 256], epsilon 1 -> 0.04 over 16% of the frames).
Needs a running stack and torchrl (``pip install -e '.[torchrl]'``):

    claw up                                       # in another terminal
    python examples/torchrl_dqn.py                # 30k frames; greedy evaluation at the end
"""

from __future__ import annotations

import argparse
import time

import torch
from tensordict.nn import TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import TensorDictReplayBuffer
from torchrl.envs import GymEnv, RewardSum, TransformedEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, HardUpdate

from orchestrator.adapters.torchrl import ClawPrioritizedSampler, ClawSampler, ClawStorage


def make_env(seed: int) -> TransformedEnv:
    env = TransformedEnv(GymEnv("CartPole-v1"), RewardSum())
    env.set_seed(seed)
    return env


def evaluate(actor: nn.Module, episodes: int, seed: int) -> float:
    """Mean return of the greedy policy over ``episodes`` episodes."""
    env = make_env(seed + 10_000)
    returns = []
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        for _ in range(episodes):
            td = env.rollout(500, actor)
            returns.append(td["next", "reward"].sum().item())
    env.close()
    return sum(returns) / len(returns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="torchrl-dqn")
    p.add_argument("--frames", type=int, default=30_000)
    p.add_argument("--init", type=int, default=1000, help="random frames before learning")
    p.add_argument("--frames-per-batch", type=int, default=256)
    p.add_argument("--gradient-steps", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sampler", choices=["priority", "uniform"], default="priority")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small nets: more threads only spin against the workers

    env = make_env(args.seed)
    net = MLP(in_features=4, out_features=2, num_cells=[256, 256], activation_class=nn.ReLU)
    actor = QValueActor(net, in_keys=["observation"], spec=env.action_spec)
    greedy = EGreedyModule(
        env.action_spec, eps_init=1.0, eps_end=0.04, annealing_num_steps=int(0.16 * args.frames)
    )
    explore = TensorDictSequential(actor, greedy)
    loss = DQNLoss(actor, loss_function="smooth_l1", delay_value=True, action_space="one-hot")
    loss.make_value_estimator(gamma=0.99)
    target = HardUpdate(loss, value_network_update_interval=args.gradient_steps)
    optim = torch.optim.Adam(loss.parameters(), lr=2.3e-3)

    storage = ClawStorage(100_000, args.namespace, timeout=120)
    sampler = (
        ClawPrioritizedSampler(alpha=0.6, beta=0.4)
        if args.sampler == "priority"
        else (ClawSampler())
    )
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=args.batch_size)
    collector = Collector(
        env,
        explore,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.frames,
        init_random_frames=args.init,
    )

    started, frames, updates, returns = time.monotonic(), 0, 0, []
    for data in collector:
        frames += data.numel()
        greedy.step(data.numel())
        ended = data["next", "done"].reshape(-1)
        returns += data["next", "episode_reward"].reshape(-1)[ended].tolist()
        rb.extend(data.reshape(-1))
        if frames < args.init:
            continue
        for _ in range(args.gradient_steps):
            batch = rb.sample()
            out = loss(batch)
            optim.zero_grad()
            out["loss"].backward()
            nn.utils.clip_grad_norm_(loss.parameters(), 10.0)
            optim.step()
            target.step()
            rb.update_tensordict_priority(batch)  # the loss wrote "td_error" into batch
            updates += 1
        recent = returns[-20:]
        if recent and frames % (20 * args.frames_per_batch) < args.frames_per_batch:
            mean = sum(recent) / len(recent)
            print(
                f"frames {frames}: {updates} updates, mean return of the last "
                f"{len(recent)} episodes {mean:.1f}",
                flush=True,
            )
    collector.shutdown()
    mean = evaluate(actor, args.eval_episodes, args.seed)
    print(
        f"done: {frames} frames, {updates} updates in {time.monotonic() - started:.0f} s; "
        f"{len(rb)} rows in namespace {storage.namespace}; greedy mean return over "
        f"{args.eval_episodes} episodes: {mean:.1f}"
    )
    storage.close()


if __name__ == "__main__":
    main()
