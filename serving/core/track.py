"""Tracking points: where a verify window crosses a multiple of the track interval, the
recurrent state after the crossing step is snapshotted (for the prefix cache's checkpoints).

Rules (reference/serving.md): the interval is resolved once at start-up for every consumer and
sits on the checkpoint grid `lcm(state_chunk, tree_page)` with `state_chunk = max(64,
page_size)` and `tree_page = page_size * dcp_size`, so a snapshot lands at a depth the radix
tree can name and the chunked prefill has a state at.
"""

from __future__ import annotations

from typing import NamedTuple

from kimi_linear_jax.cache import KDA_CHUNK, CacheLayout  # noqa: F401  (KDA_CHUNK re-exported)


def checkpoint_grid(page_size: int, dcp_size: int = 1) -> int:
    """lcm(state_chunk, tree_page): the depths where recurrent-state checkpoints may live."""
    return CacheLayout(2, page_size, dcp_size).checkpoint_grid


def resolve_track_interval(requested: int | None, page_size: int, dcp_size: int = 1) -> int:
    """The one track interval for the engine: the grid itself by default; a requested interval
    must be a positive multiple of the grid (ValueError naming both otherwise)."""
    grid = checkpoint_grid(page_size, dcp_size)
    if requested is None:
        return grid
    if requested <= 0 or requested % grid:
        raise ValueError(
            f"track_interval {requested} must be a positive multiple of the checkpoint grid "
            f"{grid} = lcm(max(64, page_size={page_size}), page_size * dcp_size={dcp_size})"
        )
    return requested


class TrackPoint(NamedTuple):
    to_track: bool  # the window crosses a multiple of the interval
    point: int  # that multiple (the sequence length the snapshot stands for)
    ith: int  # the window step whose resulting state is the snapshot


def track_point(seq_pre: int, seq_post: int, interval: int) -> TrackPoint:
    """For a window that takes a sequence from `seq_pre` to `seq_post` tokens. When the window
    crosses two multiples, the later one is tracked (one snapshot per window)."""
    to_track = seq_pre // interval != seq_post // interval
    point = seq_post // interval * interval
    return TrackPoint(to_track, point, max(point - seq_pre - 1, 0))


def can_track(tp: TrackPoint, commit_lens: int) -> bool:
    """The snapshot is valid only if its step was accepted: step ith < commit_lens."""
    return tp.to_track and tp.ith < commit_lens
