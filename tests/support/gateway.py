"""The capture gateway's stack for the tests and benches that run it over real sockets:
the vLLM-like upstream (tests/support/llm_upstream.py) and ``claw gateway`` as server
subprocesses, the agents' and the reward endpoint's tokens, and the small byte-level BPE
the upstream tokenizes with (trained here: nothing downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.support.paths import ROOT
from tests.support.processes import free_port

TOKEN = "agent-secret-123"
REWARD_TOKEN = "reward-secret-456"
TOKENS = {"CLAW_GATEWAY_TOKEN": TOKEN, "CLAW_GATEWAY_REWARD_TOKEN": REWARD_TOKEN}
"""The gateway's environment for the agents' and the reward endpoint's tokens."""


class Proc:
    """A server subprocess, ready once its port answers HTTP."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.port, self.log = port, log
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        # A loaded 2-core machine takes over a minute to import torch in the model server.
        deadline = time.monotonic() + 240
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = log.read_text()[-3000:]
                    raise RuntimeError(f"{cmd[:4]} did not start:\n{tail}") from None
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def train_tokenizer(path: Path) -> None:
    """A byte-level BPE trained here on a small corpus like the test conversations."""
    corpus = [
        "You add numbers with the tool. What is 12 plus 30? The answer is 42.",
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
        "ok, done. the sum is seven. Please add 5 and 9, then tell me the answer.",
        "system user assistant tool The answer is 7. What is 2 plus 2?",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))


def start_upstream(tokenizer: Path, log: Path, *extra: str) -> Proc:
    """``python -m tests.support.llm_upstream PORT TOKENIZER [extra]`` on a free port (it
    has no /healthz: any HTTP answer, a 404, means it is up)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.support.llm_upstream", str(port), str(tokenizer), *extra]
    return Proc(cmd, port, log, {})


def gateway_argv(
    upstream: str, namespace: str, port: int, *extra: str, redis_url: str | None = None
) -> list[str]:
    """The ``claw gateway`` command line (``--redis-url`` when given, else the env's)."""
    cmd = [sys.executable, "-m", "orchestrator.cli.main"]
    if redis_url is not None:
        cmd += ["--redis-url", redis_url]
    cmd += ["gateway", "--upstream", upstream, "--namespace", namespace, "--port", str(port)]
    return [*cmd, *extra]


def start_gateway(
    upstream: str,
    namespace: str,
    logs: Path,
    *extra: str,
    redis_url: str | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """``claw gateway`` on a free port with :data:`TOKENS` (and ``env`` over them), its
    output in ``logs/gateway-<port>.log``, its spool ``logs/spool-<port>`` unless ``extra``
    names one."""
    port = free_port()
    if "--spool" not in extra:
        extra = (*extra, "--spool", str(logs / f"spool-{port}"))
    cmd = gateway_argv(upstream, namespace, port, *extra, redis_url=redis_url)
    return Proc(cmd, port, logs / f"gateway-{port}.log", {**TOKENS, **(env or {})})
