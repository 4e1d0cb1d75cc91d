"""What a ``sample()`` of the RLlib buffers asks for: the request checked against what
they serve, and an n-step range's rows split over its n's."""

from __future__ import annotations


def n_step_rows(size: int, n: int | tuple[int, int]) -> list[tuple[int, int]]:
    """``(n, rows)`` of a sample of ``size`` rows: all at one n, or for a range ``(lo,
    hi)`` (RLlib's: n uniform in lo..hi-1 per row) the rows split evenly over the n's, the
    first ones taking the remainder. Stratified rather than drawn per row: each n has its
    own recipe, and a fixed split keeps every recipe's batch size fixed."""
    if isinstance(n, int):
        return [(n, size)]
    ns = range(n[0], n[1])
    share, extra = divmod(size, len(ns))
    rows = [(k, share + (i < extra)) for i, k in enumerate(ns)]
    return [(k, r) for k, r in rows if r]


def check_sample_request(
    buffer: str,
    default_size: int,
    num_items: int | None,
    batch_size_B: int | None,
    beta: float | None,
    n_step: int | tuple[int, int] | None,
    batch_length_T: int | None,
    min_batch_length_T: int,
    include_infos: bool,
    include_extra_model_outputs: bool,
    sample_episodes: bool | None,
) -> tuple[int, int | tuple[int, int], float]:
    """The size, the n (or range) and the beta of a ``sample()`` request to ``buffer`` (its
    class name, for the messages; ``default_size``: its ``batch_size_B``); raises on what
    these buffers do not serve."""
    if num_items is not None and batch_size_B is not None:
        raise ValueError("sample(): pass num_items or batch_size_B, not both")
    size = int(num_items or batch_size_B or default_size)
    beta = 0.0 if beta is None else float(beta)
    if sample_episodes is False:
        raise NotImplementedError(
            f"{buffer} returns n-step transitions as episodes "
            "(sample_episodes=True, as DQN and SAC ask); B x T sequence batches are not served"
        )
    if batch_length_T or min_batch_length_T:
        raise NotImplementedError(
            f"{buffer}: sequences (batch_length_T, stateful modules) are not "
            "served; use RLlib's EpisodeReplayBuffer for them"
        )
    if include_infos or include_extra_model_outputs:
        raise NotImplementedError(
            f"{buffer} stores observations, actions, rewards and flags: "
            "include_infos / include_extra_model_outputs are not served"
        )
    if isinstance(n_step, tuple | list):
        lo, hi = (int(x) for x in n_step)
        if not 1 <= lo < hi:
            raise ValueError(f"n_step={tuple(n_step)}: a range (lo, hi), 1 <= lo < hi")
        return size, (lo, hi), beta
    n = int(n_step or 1)
    if n < 1:
        raise ValueError(f"n_step={n_step}: must be >= 1")
    return size, n, beta
