"""Real Atari frames through Claw: Redis bytes per step, ingest and prefetch, raw vs compressed.

    .venv/bin/python bench/atari.py [--steps 3000] [--games Pong,Breakout,MsPacman]
        [--parts codecs,store,ingest,prefetch] [--batches 40] [--codecs none,png] [--loops drq]

Needs ale-py (the ``bench`` extra: ``pip install -e '.[bench]'``; the ROMs ship in its
wheel). Plays each game with a random policy (``ALE/<Game>-v5``: frame skip 4, sticky
actions 0.25, seed 0) and keeps every observation as 84x84x3 RGB and 84x84 grayscale
(``cv2.INTER_AREA``), episode ends included (their final frame as an explicit
``next_obs``). Then, for each game and frame kind, in one run on a private redis-server:

- ``codecs``: the codecs alone on the frames, per frame, one core: compression ratio,
  encode and decode frames/s (zstd level 3, lz4, PNG, delta to the episode's previous frame
  then zstd).
- ``store``: Redis bytes per step of each schema codec (``Store.commit``, no Celery):
  ``used_memory`` before and after, divided by the steps, raw first.
- ``ingest``: committed steps/s through a real Celery ingest worker (``Ingestor.add_batch``,
  512-step batches), each codec, encoded by the producer or the worker; and steps per
  CPU-second of the producer, the worker (pool included) and redis-server together, which
  a loaded machine does not skew the way it skews wall time.
- ``prefetch``: the prefetch fill loop of one process (as ``bench/prefetch.py``): a DQN
  recipe with ``frame_stack: 4`` (each frame stored once, stacked by the sampler), batch
  256, obs and next_obs, random shift pad 4; augmented stacked images per second of worker
  CPU time, decode included.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import lz4.block
import numpy as np
import psutil
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefetch import run as fill_loop
from bench.prefetch import trainer
from claw_tasks.client import Ingestor
from claw_tasks.codecs.engines import engine
from claw_tasks.codecs.spec import Codec
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from claw_tasks.store.keyscan import scan_keys
from orchestrator.delivery.registry import Registry
from orchestrator.recipe.model import Recipe
from tests.support.processes import Worker

GAMES = ("Pong", "Breakout", "MsPacman")
KINDS = {"rgb": (84, 84, 3), "gray": (84, 84)}


# ---- frames ---------------------------------------------------------------------------
@dataclass
class Play:
    """A random policy's steps of one game: frames of both kinds, episode structure."""

    game: str
    frames: dict[str, np.ndarray]  # kind -> (n, *shape) uint8: each step's obs
    last: dict[str, np.ndarray]  # kind -> (episodes ended, *shape): their final frames
    episode: np.ndarray  # int64 episode number per step
    step_index: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray

    @property
    def n(self) -> int:
        return len(self.step_index)

    def ends(self) -> np.ndarray:
        return np.flatnonzero(self.terminated | self.truncated)


def _kinds(rgb: np.ndarray) -> dict[str, np.ndarray]:
    small = cv2.resize(rgb, (84, 84), interpolation=cv2.INTER_AREA)
    return {"rgb": small, "gray": cv2.cvtColor(small, cv2.COLOR_RGB2GRAY)}


def play(game: str, steps: int, seed: int = 0) -> Play:
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5")
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    frames: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    last: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    cols: dict[str, list[Any]] = {k: [] for k in ("episode", "step", "a", "r", "term", "trunc")}
    ep = t = 0
    for _ in range(steps):
        for k, f in _kinds(obs).items():
            frames[k].append(f)
        action = env.action_space.sample()
        obs, reward, term, trunc, _ = env.step(action)
        for key, v in zip(cols, (ep, t, action, reward, term, trunc), strict=True):
            cols[key].append(v)
        t += 1
        if term or trunc:
            for k, f in _kinds(obs).items():
                last[k].append(f)
            obs, _ = env.reset()
            ep, t = ep + 1, 0
    env.close()
    return Play(
        game,
        {k: np.stack(v) for k, v in frames.items()},
        {k: np.stack(v) if v else np.zeros((0, *KINDS[k]), np.uint8) for k, v in last.items()},
        np.array(cols["episode"], np.int64),
        np.array(cols["step"], np.int64),
        np.array(cols["a"], np.int64),
        np.array(cols["r"], np.float32),
        np.array(cols["term"], bool),
        np.array(cols["trunc"], bool),
    )


# ---- the codecs alone -----------------------------------------------------------------
def _bgr(f: np.ndarray) -> np.ndarray:
    """RGB <-> BGR as a contiguous copy (gray frames pass)."""
    return np.ascontiguousarray(f[..., ::-1]) if f.ndim == 3 else f


def _per_frame(fn: Callable[[np.ndarray], Any], frames: np.ndarray) -> tuple[list[Any], float]:
    t0 = time.process_time()
    out = [fn(f) for f in frames]
    return out, time.process_time() - t0


def codec_table(p: Play, kind: str) -> list[tuple[str, float, float, float]]:
    """(codec, ratio, encode frames/s, decode frames/s) on one core, frame by frame."""
    frames = p.frames[kind]
    raw, n = frames.nbytes, len(frames)
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    size = frames[0].nbytes
    prev = np.concatenate([np.zeros_like(frames[:1]), frames[:-1]])
    prev[p.step_index == 0] = 0  # a key frame at each episode start
    delta = frames - prev  # uint8, wraps: decoded as prev + delta
    png = engine(Codec.of("png"))
    rows = []
    for name, enc, dec, src in [
        ("zstd level 3", lambda f: zc.compress(f.tobytes()), zd.decompress, frames),
        (
            "lz4",
            lambda f: lz4.block.compress(f.tobytes(), store_size=False),
            lambda b: lz4.block.decompress(b, uncompressed_size=size),
            frames,
        ),
        (
            "png (the codec: level 6, unfiltered rows, decoded as RGB)",
            png.encode,
            lambda b: png.decode(b, size, frames.shape[1:]),
            frames,
        ),
        (
            "png before: level 6, libpng's adaptive filters, BGR decode flipped to RGB",
            lambda f: cv2.imencode(".png", _bgr(f), [cv2.IMWRITE_PNG_COMPRESSION, 6])[1].tobytes(),
            lambda b: _bgr(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_UNCHANGED)),
            frames,
        ),
        (
            "delta to the previous frame, zstd 3",
            lambda f: zc.compress(f.tobytes()),
            zd.decompress,
            delta,
        ),
    ]:
        packed, t_enc = _per_frame(enc, src)
        _, t_dec = _per_frame(dec, packed)
        rows.append((name, raw / sum(len(b) for b in packed), n / t_enc, n / t_dec))
    return rows


# ---- the store ------------------------------------------------------------------------
def step_batches(p: Play, kind: str, size: int = 512) -> Iterator[StepBatch]:
    """The play as committable batches (episodes span batches, as a producer sends them)."""
    ends = set(p.ends().tolist())
    last_of = {int(e): i for i, e in enumerate(p.ends().tolist())}
    for lo in range(0, p.n, size):
        hi = min(p.n, lo + size)
        rows = [i for i in range(lo, hi) if i in ends]
        yield StepBatch(
            episode=StrColumn.of([f"{p.game}-{e}" for e in p.episode[lo:hi].tolist()]),
            step_index=p.step_index[lo:hi],
            reward=p.reward[lo:hi],
            terminated=p.terminated[lo:hi],
            truncated=p.truncated[lo:hi],
            fields={"obs": p.frames[kind][lo:hi], "action": p.action[lo:hi]},
            next_rows=np.array([i - lo for i in rows], np.int32),
            next_obs=np.stack([p.last[kind][last_of[i]] for i in rows]) if rows else None,
        )


def schema_for(kind: str, codec: str | None) -> Schema:
    obs = FieldSpec("|u1", KINDS[kind], codec=codec)
    return Schema(fields={"obs": obs, "action": FieldSpec("<i8", ())})


def key_bytes(r: Any, namespace: str) -> tuple[int, int]:
    """(bytes of the namespace's obs payload keys, bytes of all its keys): ``MEMORY USAGE
    ... SAMPLES 0`` (every element of a hash counted, not a sample)."""
    obs = total = 0
    keys = [k.key for k in scan_keys(r, namespace)]
    with r.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
        sizes = pipe.execute()
    for key, size in zip(keys, sizes, strict=True):
        name = key.decode() if isinstance(key, bytes) else key
        total += int(size or 0)
        if ":obs:" in name or ":nx:" in name:  # the field's chunks, explicit next_obs
            obs += int(size or 0)
    return obs, total


def fill(r: Any, namespace: str, p: Play, kind: str, codec: str | None) -> Store:
    store = Store(r, namespace)
    store.create(capacity=p.n, schema=schema_for(kind, codec))
    for b in step_batches(p, kind):
        store.commit(b)
    return store


def store_bytes(srv: RedisServer, p: Play, kind: str, codec: str | None) -> tuple[float, float]:
    """Redis bytes per stored step of a namespace holding the whole play: its obs payload
    keys, and all its keys."""
    r = srv.client()
    r.flushdb()
    fill(r, "bytes", p, kind, codec)
    obs, total = key_bytes(r, "bytes")
    r.flushdb()
    return obs / p.n, total / p.n


CODECS: list[str | None] = [None, "zstd", "lz4", "png", "delta", "delta:64"]
"""The obs field's codec in each namespace (None: raw bytes, as before codecs); ``delta``
keeps a key frame every 16 steps of an episode, ``delta:64`` every 64."""
INGEST = [
    (None, "producer"),
    ("zstd", "producer"),
    ("zstd", "worker"),
    ("png", "producer"),
    ("delta", "producer"),
]
"""(codec, who encodes) of the ingest runs."""


# ---- ingest ---------------------------------------------------------------------------
def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) so far of these processes and all their children."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                t = proc.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def ingest_rate(
    url: str, p: Play, kind: str, codec: str | None, at: str, pids: list[int], flush: int = 512
) -> tuple[float, float]:
    """Committed steps/s through the real ingest worker, first add to last confirmation
    (the producer's encoding included when ``at`` is ``producer``), and steps per CPU
    second of everything involved (``pids``: this process, the worker, redis-server)."""
    namespace = f"ingest-{p.game}-{kind}-{codec}-{at}"
    ing = Ingestor(
        namespace,
        url,
        flush_steps=flush,
        flush_interval=None,
        capacity=p.n + 10,
        schema=schema_for(kind, codec),
        compress_at=at,
    )
    cols = {
        "obs": p.frames[kind],
        "action": p.action,
        "reward": p.reward,
        "episode_id": np.array([f"{p.game}-{e}" for e in p.episode.tolist()]),
        "step_index": p.step_index,
        "terminated": p.terminated,
        "truncated": p.truncated,
    }
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    ing.add_batch(cols)
    res = ing.close(timeout=600)
    dt, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
    assert res.committed == p.n, res
    return p.n / dt, p.n / cpu


# ---- the prefetch fill loop -----------------------------------------------------------
LOOPS = {
    # bench/prefetch.py's loop (the >= 20,000 goal): 84x84x3 obs and next_obs, DrQ shift
    "drq": ("rgb", 1),
    # DQN on Atari: 84x84 grayscale, stacks of 4 frames stored once
    "dqn-stack4": ("gray", 4),
}


def prefetch_rates(
    srv: RedisServer, p: Play, loop: str, codec: str | None, batches: int
) -> tuple[float, float]:
    """Augmented images/s (obs and next_obs; a stack counts once) per worker core, and wall
    clock, of the fill loop."""
    kind, k = LOOPS[loop]
    r = srv.client()
    r.flushdb()
    store = fill(r, "fill", p, kind, codec)
    recipe = Recipe.model_validate(
        {
            "name": loop,
            "batch_size": 256,
            "fields": ["obs", "next_obs", "action", "reward"],
            "sources": [{"name": "all"}],
            "frame_stack": k,
            "prefetch": {"depth": 8},
            "seed": 1,
            "augment": {"obs": [{"random_shift": {"pad": 4}}], "next_obs": "same"},
        }
    )
    ctx = mp.get_context("spawn")
    got, send = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    reader = ctx.Process(target=trainer, args=(got, ready), daemon=True)
    reader.start()
    ready.wait()  # its segments are released from the first batch on
    reg = Registry(store)
    fill_loop(reg, recipe, 3, send)  # warm up: index, caches
    wall, cpu = fill_loop(reg, recipe, batches, send)
    send.send_bytes(b"")
    reader.join()
    r.flushdb()
    images = batches * 256 * 2
    return images / cpu, images / wall


# ---- report ---------------------------------------------------------------------------
def table(head: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--games", default=",".join(GAMES))
    ap.add_argument("--parts", default="codecs,store,ingest,prefetch")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--codecs", help="prefetch: these obs codecs only (none,png,...)")
    ap.add_argument("--loops", default=",".join(LOOPS), help="prefetch: these loops only")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    cv2.setNumThreads(1)
    plays = [play(g, args.steps) for g in args.games.split(",")]
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {args.steps:,} random-policy steps per game"
    )
    for p in plays:
        print(f"{p.game}: {len(p.ends())} episodes ended")
    if "codecs" in parts:
        rows = []
        for p in plays:
            for kind in KINDS:
                for name, ratio, enc, dec in codec_table(p, kind):
                    rows.append([p.game, kind, name, f"{ratio:.1f}x", f"{enc:,.0f}", f"{dec:,.0f}"])
        print("\nThe codecs alone, frame by frame, one core:\n")
        print(
            table(["game", "frame", "codec", "ratio", "encode frames/s", "decode frames/s"], rows)
        )
    with RedisServer() as srv:
        if "store" in parts:
            rows = []
            for p in plays:
                for kind in KINDS:
                    frame = math.prod(KINDS[kind])
                    base = None
                    for codec in CODECS:
                        obs, total = store_bytes(srv, p, kind, codec)
                        base = base or (obs, total)
                        rows.append(
                            [
                                p.game,
                                kind,
                                codec or "none",
                                f"{obs:,.0f}",
                                f"{frame / obs:.1f}x",
                                f"{total:,.0f}",
                                f"{base[1] / total:.1f}x",
                            ]
                        )
            print(
                f"\nRedis bytes per stored step, {args.steps:,} steps a namespace (load "
                f"average {os.getloadavg()[0]:.1f}):\n"
            )
            head = [
                "game",
                "frame",
                "obs codec",
                "obs bytes/step",
                "frame bytes / obs bytes",
                "all keys bytes/step",
                "vs raw (all keys)",
            ]
            print(table(head, rows))
        if "ingest" in parts:
            rows = []
            log = Path("/tmp/claw-bench-atari-worker.log")
            worker = Worker(srv.url, "ingest", 2, log, {})
            redis_pid = int(srv.client().info("server")["process_id"])
            pids = [os.getpid(), worker.proc.pid, redis_pid]
            try:
                for p in plays:
                    for kind in KINDS:
                        base = None
                        for codec, at in INGEST:
                            rate, per_cpu = ingest_rate(srv.url, p, kind, codec, at, pids)
                            base = base or (rate, per_cpu)
                            who = f"{codec}, encoded by the {at}" if codec else "none"
                            rows.append(
                                [
                                    p.game,
                                    kind,
                                    who,
                                    f"{rate:,.0f}",
                                    f"{rate / base[0]:.2f}",
                                    f"{per_cpu:,.0f}",
                                    f"{per_cpu / base[1]:.2f}",
                                ]
                            )
                            srv.client().flushdb()
            finally:
                worker.stop()
            print(
                f"\nIngest through one Celery worker (prefork, 2 processes), 512-step "
                f"batches (load average {os.getloadavg()[0]:.1f}):\n"
            )
            head = [
                "game",
                "frame",
                "obs codec",
                "committed steps/s (wall)",
                "vs raw",
                "steps per CPU-second (all processes)",
                "vs raw",
            ]
            print(table(head, rows))
        if "prefetch" in parts:
            rows = []
            codecs = CODECS
            if args.codecs:
                codecs = [None if c == "none" else c for c in args.codecs.split(",")]
            for p in plays:
                for loop in args.loops.split(","):
                    base = None
                    for codec in codecs:
                        cpu, wall = prefetch_rates(srv, p, loop, codec, args.batches)
                        base = base or cpu
                        rows.append(
                            [
                                p.game,
                                loop,
                                codec or "none",
                                f"{cpu:,.0f}",
                                f"{cpu / base:.2f}",
                                f"{wall:,.0f}",
                            ]
                        )
            print(
                f"\nPrefetch fill loop, batch 256, obs + next_obs, random shift pad 4 "
                f"(load average {os.getloadavg()[0]:.1f}):\n"
            )
            head = [
                "game",
                "loop",
                "obs codec",
                "augmented images/s per worker core",
                "vs raw",
                "wall clock images/s",
            ]
            print(table(head, rows))


if __name__ == "__main__":
    main()
