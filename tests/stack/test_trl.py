"""TRL's GRPOTrainer on Claw's group batches (examples/trl_grpo.py): the rollouts its
inference server generated go through `claw gateway` into the store, come back as group
batches, and reach TRL's loss token for token; as a slow test, the task is learnt."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from claw_tasks.store import Store
from tests.support.processes import run_example

pytest.importorskip("trl", reason="the trl extra: pip install -e '.[trl]'")


def key(row: dict) -> tuple:
    """A row as TRL sees it: prompt, completion, sampling log-probs (float32), loss mask."""
    lps = tuple(np.float32(row["logprobs"]).tolist())
    return tuple(row["prompt_ids"]), tuple(row["completion_ids"]), lps, tuple(row["loss_mask"])


def grpo(rewards: np.ndarray) -> np.ndarray:
    """GRPO advantages of one group (sample std, TRL's 1e-4)."""
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)


def test_trl_consumes_exactly_the_tokens_and_logprobs_claw_served(
    redis_url, workers, namespace, tmp_path: Path
):
    """3 updates of 2 groups of 4: every completion the server generated was recorded by
    the gateway, served once in a Claw group batch, and TRL's loss got exactly its prompt
    ids, completion ids and log-probs (float32, bit for bit), with advantages that are the
    GRPO advantages of the rewards the agents posted, group by group."""
    record = tmp_path / "record.json"
    out = run_example(
        "trl_grpo.py",
        redis_url,
        "--namespace",
        namespace,
        *("--updates", "3", "--groups", "2", "--group-size", "4", "--agents", "8"),
        *("--record", str(record)),
    )
    assert "done: 3 updates" in out, out
    assert "0 batches out of TRL's order" in out, out
    rec = json.loads(record.read_text())
    generated, served, consumed = rec["generated"], rec["served"], rec["consumed"]
    assert len(generated) == len(served) == len(consumed) == 3 * 2 * 4

    # what the server generated == what Claw served (the gateway recorded it token-exactly)
    truth = Counter(
        (tuple(g["prompt_ids"]), tuple(g["response_ids"]), tuple(np.float32(g["logprobs"])))
        for g in generated
    )
    got = Counter(
        (tuple(s["prompt_ids"]), tuple(s["completion_ids"]), tuple(np.float32(s["logprobs"])))
        for s in served
    )
    assert got == truth
    # what Claw served == what TRL's loss consumed, row for row (TRL shuffles the rows)
    as_served = Counter(key({**s, "loss_mask": s["env_mask"]}) for s in served)
    assert Counter(key(c) for c in consumed) == as_served
    assert {len(c["completion_ids"]) for c in consumed} <= {1, 2}
    # the rewards: the verifier's, posted by the agents; TRL's advantages are GRPO's of them
    adv = {}
    for b in range(3):
        rows = [s for s in served if s["batch"] == b]
        for g in {s["claw_group"] for s in rows}:
            grp = [s for s in rows if s["claw_group"] == g]
            assert len(grp) == 4 and len({tuple(s["prompt_ids"]) for s in grp}) == 1
            a = grpo(np.array([s["claw_reward"] for s in grp]))
            for s, v in zip(grp, a, strict=True):
                adv.setdefault(key({**s, "loss_mask": s["env_mask"]}), []).append(v)
    for c in consumed:
        want = adv[key(c)]
        assert any(abs(c["advantage"] - v) < 1e-4 for v in want), (c, want)
    # each trajectory a stored, rewarded turn; the policy version is the trainer's step
    store = Store(redis_url, namespace)
    cols = store.meta_columns(0, ["flags", "policy_version", "t:final_reward"])
    alive = cols["alive"]
    assert alive.sum() == len(generated)
    assert (cols["flags"][alive] & 1).all()
    assert np.isin(cols["t:final_reward"][alive], [0.0, 1.0]).all()
    assert sorted(Counter(cols["policy_version"][alive].tolist())) == [0, 1, 2]
    steps = {s for row in served for s in row["claw_step_ids"]}
    assert len(steps) == len(served)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_trl_grpo_learns(redis_url, workers, namespace):
    """With seed 0, 200 updates raise the exact success rate by at least 15 points
    (measured: +20.9 and +38.3; docs/benchmarks.md, "TRL GRPO")."""
    out = run_example(
        "trl_grpo.py", redis_url, "--namespace", namespace, "--updates", "200", timeout=2300
    )
    print(out)
    gain = float(re.search(r"\(([+-][\d.]+) points\)", out).group(1))
    assert gain >= 15, out
