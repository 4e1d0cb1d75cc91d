"""MAPPO with a centralised critic, recorded and trained through Claw's joint batches.

A small cooperative PettingZoo env (``Gather``, below): up to four agents on a 5x5 grid,
each heading for its own target; an agent that reaches it leaves (terminated: it dies
mid-episode) and ``agent_3`` joins at step 4. The team's return is the sum of every
agent's rewards (+1 on reaching the target, -0.05 per step on the way). The actors are one
shared network over each agent's own observation (decentralised execution); the critic
sees the global state (centralised training).

Each iteration records its episodes through ``RecordParallelSteps`` (tagged with the
policy version), then draws them back as one joint batch, ``(B, n_agents, ...)`` per-agent
fields with their presence mask, the state and next state, the team reward: the recipe's
``recent`` sampler over joint steps whose ``policy_version`` is the iteration's. GAE over
each episode's joint steps, a PPO update of the actors and the critic. Needs a running
stack and torch (``claw up`` in another terminal):

    python examples/mappo_gather.py --seeds 3 --iterations 40 --png mappo-gather.png
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from pettingzoo.utils.env import ParallelEnv
from torch import nn

from claw_tasks.client import Ingestor
from claw_tasks.client.pettingzoo import RecordParallelSteps
from claw_tasks.format.joint import joint_code
from orchestrator import sample

AGENTS = ["agent_0", "agent_1", "agent_2", "agent_3"]
SIZE, HORIZON, JOIN = 5, 20, 4
MOVES = np.array([[0, 0], [0, 1], [0, -1], [-1, 0], [1, 0]])  # stay, up, down, left, right


class Gather(ParallelEnv):
    """Agents walk to their own targets; ``agent_3`` joins at step ``JOIN``."""

    metadata = {"name": "gather_v0"}

    def __init__(self) -> None:
        self.possible_agents = list(AGENTS)
        self.agents: list[str] = []
        self.rng = np.random.default_rng()
        self.pos = np.zeros((len(AGENTS), 2), np.int64)
        self.target = np.zeros((len(AGENTS), 2), np.int64)
        self.t = 0

    def observation_space(self, agent: str) -> spaces.Space:
        return spaces.Box(-1.0, 1.0, (4,), np.float32)

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(len(MOVES))

    def _place(self, i: int) -> None:
        self.pos[i] = self.rng.integers(SIZE, size=2)
        while True:
            self.target[i] = self.rng.integers(SIZE, size=2)
            if (self.target[i] != self.pos[i]).any():
                return

    def _obs(self, agent: str) -> np.ndarray:
        i = AGENTS.index(agent)
        p, g = self.pos[i], self.target[i]
        return (np.r_[p, g - p] / (SIZE - 1)).astype(np.float32)

    def state(self) -> np.ndarray:
        alive = np.array([a in self.agents for a in AGENTS], np.float32)
        per = np.c_[self.pos, self.target] / (SIZE - 1)
        return np.r_[(per * alive[:, None]).ravel(), alive, self.t / HORIZON].astype(np.float32)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.t = 0
        self.agents = AGENTS[:3]
        for i in range(len(AGENTS)):
            self._place(i)
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        self.t += 1
        acting = list(self.agents)
        rewards, terms, truncs = {}, {}, {}
        for a in acting:
            i = AGENTS.index(a)
            self.pos[i] = np.clip(self.pos[i] + MOVES[int(actions[a])], 0, SIZE - 1)
            terms[a] = bool((self.pos[i] == self.target[i]).all())
            rewards[a] = (1.0 if terms[a] else 0.0) - 0.05
            truncs[a] = self.t >= HORIZON and not terms[a]
        obs = {a: self._obs(a) for a in acting}
        self.agents = [a for a in acting if not (terms[a] or truncs[a])]
        if self.t == JOIN and self.agents:
            self.agents.append("agent_3")
            obs["agent_3"] = self._obs("agent_3")
        return obs, rewards, terms, truncs, {a: {} for a in obs}


def mlp(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(n_in, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, n_out)
    )


class Adam:
    """Adam, written out: ``torch.optim`` imports torch's compiler stack on first use
    (seconds of CPU, most of a short run)."""

    def __init__(self, params: list[nn.Parameter], lr: float, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    def step(self, loss: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        loss.backward()
        self.t += 1
        b1, b2 = self.betas
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v, strict=True):
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v / (1 - b2**self.t)).sqrt_().add_(self.eps)
                p.addcdiv_(m, denom, value=-self.lr / (1 - b1**self.t))


class MAPPO:
    """Shared actor over (own observation, agent one-hot); critic over the global state."""

    def __init__(self, state_dim: int, lr: float = 3e-3, gamma: float = 0.95, lam: float = 0.9):
        self.actor = mlp(4 + len(AGENTS), len(MOVES))
        self.critic = mlp(state_dim, 1)
        self.opt = Adam([*self.actor.parameters(), *self.critic.parameters()], lr)
        self.gamma, self.lam = gamma, lam

    def actor_in(self, obs: np.ndarray, agent_idx: np.ndarray) -> torch.Tensor:
        one_hot = np.eye(len(AGENTS), dtype=np.float32)[agent_idx]
        return torch.from_numpy(np.concatenate([obs, one_hot], axis=-1))

    @torch.no_grad()
    def act(self, obs: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, int]:
        names = list(obs)
        x = self.actor_in(
            np.stack([obs[a] for a in names]), np.array([AGENTS.index(a) for a in names])
        )
        p = torch.softmax(self.actor(x), -1).numpy().astype(np.float64)
        return {
            a: int(rng.choice(len(MOVES), p=pi / pi.sum())) for a, pi in zip(names, p, strict=True)
        }

    def advantages(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        """GAE over each episode's joint steps (rows sorted by episode, then step)."""
        mask = batch["mask"]
        episode = np.nanmax(batch["tags.joint_episode"], axis=1)
        t = np.where(mask, batch["step_index"], -1).max(axis=1)
        order = np.lexsort((t, episode))
        with torch.no_grad():
            v = self.critic(torch.from_numpy(batch["state"])).squeeze(-1).numpy()
            v_next = self.critic(torch.from_numpy(batch["next_state"])).squeeze(-1).numpy()
        r = batch["team_reward"]
        e, ts = episode[order], t[order]
        has_next = np.r_[(e[1:] == e[:-1]) & (ts[1:] == ts[:-1] + 1), False]
        all_term = (batch["terminated"] | ~mask).all(axis=1)[order]
        done = all_term & ~has_next  # the team's episode ended by termination
        delta = r[order] + self.gamma * v_next[order] * ~done - v[order]
        adv = np.zeros(len(order), np.float32)
        running = 0.0
        for k in range(len(order) - 1, -1, -1):
            running = delta[k] + (self.gamma * self.lam * running if has_next[k] else 0.0)
            adv[k] = running
        out = np.empty_like(adv)
        out[order] = adv
        return out, out + v

    def update(self, batch: Any, epochs: int = 4, minibatch: int = 256) -> float:
        adv, ret = self.advantages(batch)
        mask = torch.from_numpy(batch["mask"])
        b, n = mask.shape
        x = self.actor_in(batch["obs"].reshape(b * n, -1), np.tile(np.arange(n), b)).view(b, n, -1)
        act = torch.from_numpy(batch["action"].astype(np.int64))
        with torch.no_grad():
            old = torch.log_softmax(self.actor(x), -1).gather(-1, act[..., None]).squeeze(-1)
        a_t = torch.from_numpy((adv - adv.mean()) / (adv.std() + 1e-8))
        ret_t, state = torch.from_numpy(ret), torch.from_numpy(batch["state"])
        loss_sum = 0.0
        for _ in range(epochs):
            for idx in torch.randperm(b).split(minibatch):
                logits = self.actor(x[idx])
                logp = torch.log_softmax(logits, -1)
                new = logp.gather(-1, act[idx][..., None]).squeeze(-1)
                ratio = torch.exp(new - old[idx])
                a = a_t[idx][:, None]
                surr = torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
                entropy = -(logp.exp() * logp).sum(-1)
                m = mask[idx].float()
                pg = -((surr + 0.01 * entropy) * m).sum() / m.sum()
                vf = ((self.critic(state[idx]).squeeze(-1) - ret_t[idx]) ** 2).mean()
                loss = pg + 0.5 * vf
                self.opt.step(loss)
                loss_sum += float(loss.detach())
        return loss_sum


def random_returns(episodes: int, seed: int) -> list[float]:
    env, rng = Gather(), np.random.default_rng(seed)
    out = []
    for e in range(episodes):
        env.reset(seed=seed * 100_000 + e)
        total = 0.0
        while env.agents:
            _, rewards, *_ = env.step({a: int(rng.integers(len(MOVES))) for a in env.agents})
            total += sum(rewards.values())
        out.append(total)
    return out


FIELDS = ["obs", "action", "terminated", "step_index", "tags.joint_episode"]
FIELDS += ["state", "next_state", "team_reward"]  # the joint step's


def recipe(batch_size: int) -> dict[str, Any]:
    """The iteration's joint steps: newest first, of the current policy version."""
    return {
        "name": "mappo",
        "batch_size": batch_size,
        "fields": FIELDS,
        "sources": [
            {"name": "on-policy", "where": "policy_version == $v", "sampler": {"kind": "recent"}}
        ],
        "joint": {"agents": AGENTS},
        "params": {"v": 0},
    }


def train(namespace: str, seed: int, iterations: int, episodes: int, check: bool) -> list[float]:
    """Returns the mean team return of each iteration's episodes."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = Gather()
    env.reset(seed=0)
    learner = MAPPO(state_dim=env.state().shape[0])
    curve = []
    with Ingestor(namespace, flush_steps=4096, flush_interval=None) as ingestor:
        rec = RecordParallelSteps(env, ingestor, task_id="gather")
        for it in range(iterations):
            rec.policy_version = it
            taken: dict[tuple[float, int, str], int] = {}
            returns, joint_steps = [], 0
            for e in range(episodes):
                obs, _ = rec.reset(seed=seed * 100_000 + it * episodes + e + 1)
                total = 0.0
                while rec.agents:
                    actions = learner.act({a: obs[a] for a in rec.agents}, rng)
                    for a, x in actions.items():
                        taken[joint_code(rec.episode_id), rec.step_index, a] = x
                    obs, rewards, *_ = rec.step(actions)
                    total += sum(rewards.values())
                    joint_steps += 1
                returns.append(total)
            ingestor.flush()  # committed: the batch below holds every step of the iteration
            batch = sample(namespace, recipe(joint_steps), params={"v": it})
            if check:
                bookkeeping(batch, taken, joint_steps)
            learner.update(batch)
            curve.append(float(np.mean(returns)))
            print(
                f"seed {seed} iteration {it}: team return {curve[-1]:.2f} "
                f"({joint_steps} joint steps)"
            )
    return curve


def bookkeeping(batch: Any, taken: dict[tuple[float, int, str], int], joint_steps: int) -> None:
    """Every joint step of the iteration came back once, each agent's slice with the
    action it took there."""
    assert len(batch) == joint_steps, (len(batch), joint_steps)
    mask = batch["mask"]
    assert int(mask.sum()) == len(taken), (int(mask.sum()), len(taken))
    seen = set()
    for i, j in zip(*np.nonzero(mask), strict=True):
        key = (float(batch["tags.joint_episode"][i, j]), int(batch["step_index"][i, j]), AGENTS[j])
        assert batch["action"][i, j] == taken[key], key
        seen.add(key)
    assert seen == set(taken)
    print(
        f"bookkeeping ok: {joint_steps} joint steps, {len(taken)} agent steps, "
        f"{batch.meta['joint']['partial']} partial"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="mappo-gather")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--episodes", type=int, default=32, help="episodes per iteration")
    p.add_argument("--check", action="store_true", help="assert the batches' bookkeeping")
    p.add_argument("--png", default=None, help="where to draw the learning curves")
    args = p.parse_args()
    torch.set_num_threads(1)  # tiny networks: threads only contend
    start = time.monotonic()
    curves, randoms = [], []
    for seed in range(args.seeds):
        ns = f"{args.namespace}-{seed}-{time.time_ns():x}"
        curves.append(train(ns, seed, args.iterations, args.episodes, args.check))
        randoms.append(float(np.mean(random_returns(200, seed))))
    final = [float(np.mean(c[-5:])) for c in curves]
    print(
        f"team return after {args.iterations} iterations: {np.mean(final):.2f} ± "
        f"{np.std(final):.2f} (random policy {np.mean(randoms):.2f} ± {np.std(randoms):.2f}) "
        f"over {args.seeds} seeds, {time.monotonic() - start:.0f} s"
    )
    if args.png:
        plot(curves, randoms, args.png)
        print(f"learning curves: {args.png}")


def plot(curves: list[list[float]], randoms: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    c = np.array(curves)
    x = np.arange(c.shape[1])
    ax.plot(x, c.mean(0), label=f"MAPPO (mean of {len(curves)} seeds)")
    ax.fill_between(x, c.min(0), c.max(0), alpha=0.25, label="min-max over seeds")
    ax.axhline(np.mean(randoms), color="gray", ls="--", label="random policy")
    ax.set_xlabel("iteration")
    ax.set_ylabel("team return per episode")
    ax.set_title("Gather: MAPPO from Claw joint batches")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
