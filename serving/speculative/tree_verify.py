"""The tree verify step: the target runs over each row's draft tree (node 0 the row's last
token, node i's parent before it), accepts the deepest node whose path it would have emitted
itself, and commits that path: the recurrent state of the accept node (by accept index, not
`commit_lens - 1`), and the path's latent rows written at the row's next positions.

Acceptance, per node i with parent p: i is accepted when its token equals the target's token
at p, and p is accepted (the root always is). Greedy, the target's token is the argmax. Sampled,
node p draws the token the plain sampler would draw at that output position, `sample` with
the row's key for step `step + depth(p)`, and a child matching the draw is followed. Every
drafter here proposes deterministic trees (siblings distinct), for which this is the
multi-candidate rejection sampling exactly: child c of p is taken with probability p_p(c), and
the first node whose draw matches no child emits that draw, a sample of p_p restricted to the
tokens no child holds; so the text has the target's law, and it is also the text the seed gives
without speculation (as for chains, `verify.py`).

`commit_lens = depth(accept node) + 1`; the emitted tokens are the target's at each path node.
Track points (prefix cache) snapshot the state of the path node at the track step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_linear_jax.model import commit_kda, merge
from kimi_linear_jax.ops.tree import ancestors, depths
from serving.core.sampling import (
    SamplingBatch,
    apply_bias,
    apply_penalties,
    no_logprobs,
    token_logprobs,
)
from serving.core.sampling import sample as sample_tokens
from serving.speculative.verify import per_position, track_rows, write_track


def _targets(logits, depth, batch: SamplingBatch, sample: bool) -> jax.Array:
    """[B, T] the token the target emits after each node: argmax, or the plain sampler's draw
    at the node's output position (greedy rows keep the argmax)."""
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sample:
        return greedy_tokens
    b, t, v = logits.shape
    drawn, _, _ = sample_tokens(
        logits.reshape(b * t, v), per_position(batch, depth), num_top_logprobs=1
    )
    greedy = (batch.temperature <= 0.0)[:, None]
    return jnp.where(greedy, greedy_tokens, drawn.reshape(b, t))


def tree_accept(logits, ids, parents, num_nodes, batch: SamplingBatch, *, sample: bool):
    """(tokens [B, T], path [B, T], accept node [B], commit_lens [B]) over logits [B, T, V]
    for trees ids / parents [B, T] whose first num_nodes[b] nodes are valid. path[b, :d + 1]
    are the nodes from the root to the accept node, tokens[b, :d + 1] what the row emits
    (the target's token after each path node); both 0 past that."""
    anc, depth = ancestors(parents), depths(parents)
    target = _targets(logits, depth, batch, sample)
    t = ids.shape[1]
    node = jnp.arange(t)[None, :]
    parent_target = jnp.take_along_axis(target, jnp.maximum(parents, 0), axis=1)
    ok = (node > 0) & (node < num_nodes[:, None]) & (ids == parent_target)
    ok = ok | (node == 0)
    # A node is reached when every node on its path is ok (anc < 0: past the root).
    on_path = jnp.take_along_axis(ok[:, None, :], jnp.maximum(anc, 0), axis=2)
    reached = jnp.all(on_path | (anc < 0), axis=2)
    accept = jnp.argmax(jnp.where(reached, depth, -1), axis=1).astype(jnp.int32)
    d = jnp.take_along_axis(depth, accept[:, None], axis=1)[:, 0]
    # path[j] is the (d - j)-th ancestor of the accept node.
    chain = jnp.take_along_axis(anc, accept[:, None, None], axis=1)[:, 0]  # [B, T]
    j = jnp.arange(t)[None, :]
    back = jnp.clip(d[:, None] - j, 0, t - 1)
    within = j <= d[:, None]
    path = jnp.where(within, jnp.take_along_axis(chain, back, axis=1), 0)
    tokens = jnp.where(within, jnp.take_along_axis(target, path, axis=1), 0)
    live = num_nodes > 0
    return tokens, path, accept, jnp.where(live, d + 1, 0)


def _path_rows(rows, path):
    """Each MLA layer's latent rows [B, T, L + R] along the accepted path."""
    return tuple(jnp.take_along_axis(r, path[:, :, None], axis=1) for r in rows)


def _track_on_path(per_step, path, track_steps, commit_lens):
    """(the track rows, their nodes, the bound `write_track` checks them by): the state of
    path node track_steps[b] (a window step) where that step was accepted; node -1 else."""
    valid = (track_steps >= 0) & (track_steps < commit_lens)
    at = jnp.take_along_axis(path, jnp.maximum(track_steps, 0)[:, None], axis=1)[:, 0]
    nodes = jnp.where(valid, at, -1)
    reach = jnp.full_like(commit_lens, path.shape[1] + 1)  # every node index counts
    return track_rows(per_step, nodes, reach), nodes, reach


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "mode", "commit_recurrent", "track"),
    donate_argnames=("cache",),
)
def verify_tree_step(
    graphdef,
    params,
    last,
    drafts,
    parents,
    num_drafts,
    cache,
    batch,
    sampling,
    counts,
    prompt_mask,
    track_slots,
    track_steps,
    *,
    mode,
    commit_recurrent=True,
    track=True,
):
    """One tree verify over rows [B] (padding rows: batch.lengths 0): drafts and parents
    [B, n] for nodes 1..n (parents in window numbering, 0 the root). Returns ((tokens [B, T],
    commit_lens [B], logprob [B, T], top ids, top values), accepted [B, T] (the row's accepted
    window `[last, path drafts]`, for a drafter's rollback), the depth of each row's tree [B],
    cache)."""
    model = merge(graphdef, params)
    ids = jnp.concatenate([last[:, None], drafts], axis=1)
    tree = jnp.concatenate([jnp.full_like(last, -1)[:, None], parents], axis=1)
    live = batch.lengths > 0
    num_nodes = jnp.where(live, num_drafts + 1, 0)
    batch = batch._replace(lengths=num_nodes)
    logits, cache, per_step, rows = model.verify_tree(ids, tree, cache, batch)
    logits = logits.astype(jnp.float32)
    if mode == "penalized":  # penalised rows get no drafts: only the root matters
        logits = logits.at[:, 0].set(apply_penalties(logits[:, 0], counts, prompt_mask, sampling))
    if mode != "greedy":
        logits = jax.vmap(apply_bias, in_axes=(1, None), out_axes=1)(logits, sampling)
    valid = jnp.arange(ids.shape[1])[None, :] < num_nodes[:, None]
    tree_depth = jnp.max(jnp.where(valid, depths(tree), 0), axis=1)
    tokens, path, accept, commit_lens = tree_accept(
        logits, ids, tree, num_nodes, sampling, sample=mode != "greedy"
    )
    accepted = jnp.where(
        jnp.arange(ids.shape[1])[None] < commit_lens[:, None],
        jnp.take_along_axis(ids, path, axis=1),
        0,
    )
    if commit_recurrent:
        snaps, nodes, reach = (), None, None
        if track:
            snaps, nodes, reach = _track_on_path(per_step, path, track_steps, commit_lens)
        n = jnp.where(live, accept + 1, 0)
        cache = commit_kda(cache, per_step, batch.slots, n, after=(logits, snaps))
        if track:
            cache = write_track(cache, snaps, track_slots, nodes, reach)
    cache = model.write_latents(cache, _path_rows(rows, path), batch._replace(lengths=commit_lens))
    path_logits = jnp.take_along_axis(logits, path[:, :, None], axis=1)
    if mode == "greedy":
        return (tokens, commit_lens, *no_logprobs(tokens)), accepted, tree_depth, cache
    picked = (tokens, commit_lens, *token_logprobs(path_logits, tokens))
    return picked, accepted, tree_depth, cache
