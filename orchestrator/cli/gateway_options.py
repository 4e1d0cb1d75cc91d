"""`claw gateway`'s options, one type each (their help texts and defaults shown by
``--help``): the command's signature then reads as the list of what it takes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Tokenizer = Annotated[
    Path | None,
    typer.Option(help="tokenizer.json for upstreams that return no token ids"),
]
VllmOptions = Annotated[
    bool, typer.Option(help="Ask for token ids with vLLM's return_token_ids options")
]
MaxReplyBytes = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Bytes of one upstream reply kept to record it; a larger one is passed "
        "through unrecorded",
        show_default="CLAW_GATEWAY_MAX_REPLY_BYTES, 32 MiB",
    ),
]
UpstreamTimeout = Annotated[
    float | None,
    typer.Option(
        min=0.001,
        help="Seconds to wait for the upstream's headers, and between its reads",
        show_default="CLAW_GATEWAY_UPSTREAM_TIMEOUT, 300",
    ),
]
MaxTurns = Annotated[int, typer.Option(help="Calls allowed per trajectory")]
MaxN = Annotated[
    int,
    typer.Option(min=1, max=1024, help="Largest n per call (n > 1: n trajectories)"),
]
DefaultPolicyVersion = Annotated[
    int | None,
    typer.Option(
        help="Recorded as each turn's policy_version when the upstream sends no "
        "X-Claw-Policy-Version (else the trainer's declared version)"
    ),
]
Admission = Annotated[
    bool,
    typer.Option(help="Admit new trajectories against the trainer's staleness budget"),
]
AdmissionWait = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Seconds a new trajectory waits for the budget before a 429",
        show_default="CLAW_GATEWAY_ADMISSION_WAIT, 10",
    ),
]
AdmissionExpiry = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Seconds an admitted trajectory may go without a turn or its reward before "
        "its budget slots come back (0: never)",
        show_default="CLAW_GATEWAY_ADMISSION_EXPIRY, 3600",
    ),
]
RetryAfter = Annotated[float, typer.Option(min=0.001, help="Retry-After of a 429 (seconds)")]
TurnDiscount = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        max=1.0,
        help="Set the namespace's turn discount gamma (r[t] += gamma * r[t+1] at reward)",
    ),
]
SessionTtl = Annotated[
    int, typer.Option(min=1, help="Seconds a session key lives (and trajectory state)")
]
