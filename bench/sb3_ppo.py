"""SB3 PPO on CartPole-v1 with SB3's own RolloutBuffer vs ClawRolloutBuffer, in one run.

    .venv/bin/python bench/sb3_ppo.py [--steps 100000] [--chunk 2560]
        [--variants "sb3;claw;claw:form_here=1"] [--eval-episodes 20]

rl-zoo hyperparameters (8 envs x 32 steps, minibatch 256, 20 epochs, gamma 0.98, GAE
lambda 0.8, linear lr 1e-3 and clip 0.2 over the whole run, no entropy bonus), seed 0,
CPU, one torch thread. Starts a private redis-server and one real Celery worker (ingest +
prefetch, 2 processes). The variants train side by side in turns of ``--chunk`` steps
(ten rollouts), so that both see the same load on a shared machine (a whole run of one
then the other saw loads differ enough to swing the ratio from 1.2x to 2.7x); a
variant's figures add up its turns: wall time of ``learn``, the ratio to SB3's buffer,
the trainer's CPU (the process's, its threads included), the time in ``get()`` (waiting
for and converting the rollout Claw serves) and in ``compute_returns_and_advantage``,
the worker's and Redis's CPU seconds, and the final deterministic evaluation (mean
return of ``--eval-episodes`` episodes). ``claw:write_every=32`` passes integer kwargs to
the buffer; variants are separated by ``;``. By default SB3's buffer, Claw's through the
workers (``claw``) and Claw's ``form_here=True`` opt-in (``claw:form_here=1``: the
rollout committed and formed in the learner's process). Prints markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, field
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
from stable_baselines3.common.logger import Logger  # noqa: E402

from bench.cpu import group_cpu, redis_cpu  # noqa: E402
from claw_tasks.settings import get_settings  # noqa: E402
from orchestrator.adapters.sb3 import ClawRolloutBuffer  # noqa: E402
from tests.support.processes import Worker  # noqa: E402


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


class FixedSchedulePPO(PPO):
    """PPO whose schedules' progress runs over ``total`` steps, however many ``learn``
    calls make them (the bench trains in chunks, alternating the buffers)."""

    total = 100_000

    def _update_current_progress_remaining(self, num_timesteps: int, total: int) -> None:
        self._current_progress_remaining = 1.0 - float(num_timesteps) / float(self.total)


@dataclass
class Run:
    """One variant: its model and what was measured over its chunks."""

    name: str
    model: PPO
    wall: float = 0.0
    cpu: float = 0.0
    worker_cpu: float = 0.0
    redis_cpu: float = 0.0
    loads: list[float] = field(default_factory=list)
    score: float = float("nan")

    @property
    def buffer(self) -> Timed:
        return self.model.rollout_buffer  # type: ignore[return-value]


def make(name: str, total: int, k: int) -> Run:
    base, _, opts = name.partition(":")
    cls = VARIANTS[base]
    kw: dict = {"namespace": f"bench-ppo-{k}"} if cls is TimedClaw else {}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        kw[key] = int(value)
    model = FixedSchedulePPO(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=8, seed=0),
        seed=0,
        device="cpu",
        rollout_buffer_class=cls,
        rollout_buffer_kwargs=kw,
        **ZOO,
    )
    model.total = total
    model.set_logger(Logger(None, []))  # SB3's default: a SB3-<time> folder in /tmp per learn()
    return Run(name, model)


VARIANTS = {"sb3": TimedSB3, "claw": TimedClaw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--chunk", type=int, default=2560, help="steps per turn of each variant")
    ap.add_argument(
        "--variants", default="sb3;claw;claw:form_here=1", help="sb3, claw or claw:KEY=INT (kwargs)"
    )
    ap.add_argument("--eval-episodes", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    url = SERVER.url
    assert get_settings().redis_url == url
    worker = Worker(url, "ingest,prefetch", 2, Path("/tmp/claw-bench-sb3ppo-worker.log"), {})
    try:
        r = redis.Redis.from_url(url)
        runs = [make(name, a.steps, k) for k, name in enumerate(a.variants.split(";"))]
        done = 0
        while done < a.steps:
            steps = min(a.chunk, a.steps - done)
            for run in runs:  # each variant in turn: they see the same load
                run.loads.append(os.getloadavg()[0])
                w0, r0, c0 = group_cpu(worker.proc.pid), redis_cpu(r), time.process_time()
                t = time.perf_counter()
                run.model.learn(steps, reset_num_timesteps=False)
                run.wall += time.perf_counter() - t
                run.cpu += time.process_time() - c0
                run.worker_cpu += group_cpu(worker.proc.pid) - w0
                run.redis_cpu += redis_cpu(r) - r0
            done += steps
            print(
                f"{done} steps: " + ", ".join(f"{x.name} {x.wall:.1f} s" for x in runs),
                file=sys.stderr,
            )
        for run in runs:
            eval_env = make_vec_env("CartPole-v1", n_envs=1, seed=1000)
            run.score = float(
                evaluate_policy(
                    run.model, eval_env, n_eval_episodes=a.eval_episodes, deterministic=True
                )[0]
            )
            if isinstance(run.buffer, ClawRolloutBuffer):
                run.buffer.close()
    finally:
        worker.stop()
        SERVER.__exit__(None, None, None)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; torch threads 1; {a.steps} "
        f"steps in turns of {a.chunk}, seed 0\n"
    )
    print(
        "| buffer | load (min-max) | wall s | / sb3 | trainer CPU s | in get() s "
        "| in compute_returns s | worker CPU s | Redis CPU s | eval (mean of "
        f"{a.eval_episodes}) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = next((x.wall for x in runs if x.name == "sb3"), None)
    for x in runs:
        ratio = f"{x.wall / base:.2f}x" if base else "-"
        print(
            f"| {x.name} | {min(x.loads):.1f}-{max(x.loads):.1f} | {x.wall:.1f} | {ratio} "
            f"| {x.cpu:.1f} | {x.buffer.get_s:.2f} | {x.buffer.compute_s:.2f} "
            f"| {x.worker_cpu:.1f} | {x.redis_cpu:.1f} | {x.score:.1f} |"
        )


if __name__ == "__main__":
    main()
