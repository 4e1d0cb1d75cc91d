"""SB3 PPO on CartPole-v1 with SB3's own RolloutBuffer vs ClawRolloutBuffer, in one run.

    .venv/bin/python bench/sb3_ppo.py [--steps 100000] [--rounds 1] [--variants sb3,claw]
        [--eval-episodes 20]

rl-zoo hyperparameters (8 envs x 32 steps, minibatch 256, 20 epochs, gamma 0.98, GAE
lambda 0.8, linear lr 1e-3 and clip 0.2, no entropy bonus), seed 0, CPU, one torch
thread. Starts a private redis-server and one real Celery worker (ingest + prefetch, 2
processes). Reports, per run: wall time of ``learn``, the ratio to SB3's buffer in the same
round, the trainer's CPU, the time the trainer spent in ``get()`` (waiting for and
converting Claw's epochs) and in ``compute_returns_and_advantage``, the worker's and
Redis's CPU seconds during the run, and the final deterministic evaluation (mean return
of ``--eval-episodes`` episodes). Variants run in the order given, ``--rounds`` times over
(interleaved A/B under a changing load; ``claw:write_every=16`` passes integer
kwargs to the buffer); the table has one row per run with the load
average at its start. Prints markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.connection.server import RedisServer

SERVER = RedisServer().__enter__()  # before anything reads the settings: they are cached
os.environ.update(CLAW_REDIS_URL=SERVER.url, CLAW_BROKER_URL=SERVER.url)

import redis  # noqa: E402
import torch  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.buffers import RolloutBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402

from claw_tasks.settings import get_settings  # noqa: E402
from orchestrator.adapters.sb3 import ClawRolloutBuffer  # noqa: E402
from tests.support.processes import Worker  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def linear(start: float):
    return lambda progress_remaining: progress_remaining * start


ZOO = dict(
    n_steps=32,
    batch_size=256,
    gae_lambda=0.8,
    gamma=0.98,
    n_epochs=20,
    ent_coef=0.0,
    learning_rate=linear(1e-3),
    clip_range=linear(0.2),
)


class Timed:
    """Adds up the time in ``get()`` (the generator's own time, not the training between
    its minibatches) and in ``compute_returns_and_advantage`` (a mixin over either)."""

    get_s = 0.0
    compute_s = 0.0

    def get(self, *a, **kw):
        it = super().get(*a, **kw)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.get_s += time.perf_counter() - t
                return
            self.get_s += time.perf_counter() - t
            yield item

    def compute_returns_and_advantage(self, *a, **kw):
        t = time.perf_counter()
        super().compute_returns_and_advantage(*a, **kw)
        self.compute_s += time.perf_counter() - t


class TimedSB3(Timed, RolloutBuffer):
    pass


class TimedClaw(Timed, ClawRolloutBuffer):
    pass


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(cls: type, steps: int, kwargs: dict, episodes: int) -> tuple[float, float, Timed]:
    env = make_vec_env("CartPole-v1", n_envs=8, seed=0)
    model = PPO(
        "MlpPolicy",
        env,
        seed=0,
        device="cpu",
        rollout_buffer_class=cls,
        rollout_buffer_kwargs=kwargs,
        **ZOO,
    )
    t = time.perf_counter()
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - t
    buf = model.rollout_buffer
    if isinstance(buf, ClawRolloutBuffer):
        buf.close()
    eval_env = make_vec_env("CartPole-v1", n_envs=1, seed=1000)
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=episodes, deterministic=True)
    return wall, float(mean), buf  # type: ignore[return-value]


VARIANTS = {"sb3": TimedSB3, "claw": TimedClaw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", default="sb3,claw", help="sb3, claw or claw:KEY=INT,... (kwargs)")
    ap.add_argument("--eval-episodes", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    names = a.variants.split(",")
    rows = []
    url = SERVER.url
    assert get_settings().redis_url == url
    worker = Worker(url, "ingest,prefetch", 2, Path("/tmp/claw-bench-sb3ppo-worker.log"), {})
    try:
        r = redis.Redis.from_url(url)
        for k in range(a.rounds):
            for i, name in enumerate(names):
                base, _, opts = name.partition(":")
                cls = VARIANTS[base]
                kw = {"namespace": f"bench-ppo-{k}-{i}"} if cls is TimedClaw else {}
                for opt in filter(None, opts.split(",")):
                    key, _, value = opt.partition("=")
                    kw[key] = int(value)
                load = os.getloadavg()[0]
                w0, r0 = group_cpu(worker.proc.pid), redis_cpu(r)
                c0 = time.process_time()
                wall, score, buf = run(cls, a.steps, kw, a.eval_episodes)
                cpu = time.process_time() - c0
                w1, r1 = group_cpu(worker.proc.pid), redis_cpu(r)
                rows.append((k, name, load, wall, cpu, buf, w1 - w0, r1 - r0, score))
                print(f"round {k} {name}: {wall:.1f} s, eval {score:.1f}", file=sys.stderr)
    finally:
        worker.stop()
        SERVER.__exit__(None, None, None)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average at the end "
        f"{os.getloadavg()[0]:.1f}; torch threads 1; {a.steps} steps, seed 0\n"
    )
    print(
        "| round | buffer | load | wall s | / sb3 | trainer CPU s | in get() s "
        "| in compute_returns s | worker CPU s | Redis CPU s | eval (mean of "
        f"{a.eval_episodes}) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, name, load, wall, cpu, buf, w, rc, score in rows:
        base = [x[3] for x in rows if x[0] == k and x[1] == "sb3"]
        ratio = f"{wall / base[0]:.2f}x" if base else "-"
        print(
            f"| {k} | {name} | {load:.1f} | {wall:.1f} | {ratio} | {cpu:.1f} | {buf.get_s:.2f} "
            f"| {buf.compute_s:.2f} | {w:.1f} | {rc:.1f} | {score:.1f} |"
        )


if __name__ == "__main__":
    main()
