"""Drafters proposing trees: the n-gram tree equals its plain-loop reference and, with topk 1,
the chain lookup; tree invariants (parents before children, distinct siblings, the node cap);
the oracle's true branch at a chosen sibling; the draft model's tree holds at each depth its
top-k tokens after the chain prefix (against a full forward); and after a tree verify the
draft's caches hold exactly the accepted path, leaf included (against a direct prefill)."""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_linear_jax.cache import Batch, CacheLayout
from kimi_linear_jax.model import for_serving, forward
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.request import Request
from serving.core.sampling import SamplingParams
from serving.speculative.draft_model import DraftModelDrafter
from serving.speculative.drafter import Drafter
from serving.speculative.ngram import (
    NgramDrafter,
    ngram_lookup,
    ngram_tree,
    ngram_tree_reference,
)
from serving.speculative.oracle import OracleDrafter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def assert_tree(nodes, max_nodes: int, topk: int) -> None:
    """Parents come before their children, siblings differ, at most topk children a node."""
    assert len(nodes) <= max_nodes
    children = collections.defaultdict(list)
    for j, (token, parent) in enumerate(nodes):
        assert 0 <= parent <= j, nodes
        children[parent].append(token)
    for tokens in children.values():
        assert len(tokens) == len(set(tokens)) <= topk, nodes


# ---- n-gram trees -------------------------------------------------------------------------------

_random = st.lists(st.integers(0, 4), max_size=40)
# A motif repeated with a few tokens changed: occurrences that agree for a while, then part.
_repetitive = st.builds(
    lambda motif, times, edits: [edits.get(i, t) for i, t in enumerate(motif * times)],
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.integers(2, 8),
    st.dictionaries(st.integers(0, 47), st.integers(0, 9), max_size=4),
)


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.one_of(_random, _repetitive),
    max_nodes=st.integers(0, 12),
    max_n=st.integers(1, 4),
    topk=st.integers(1, 4),
    data=st.data(),
)
def test_ngram_tree_equals_its_reference(tokens, max_nodes, max_n, topk, data):
    min_n = data.draw(st.integers(1, max_n))
    tree = ngram_tree(tokens, max_nodes, max_n, min_n, topk)
    assert tree == ngram_tree_reference(tokens, max_nodes, max_n, min_n, topk)
    assert_tree(tree, max_nodes, topk)
    chain = ngram_tree(tokens, max_nodes, max_n, min_n, topk=1)
    assert [t for t, _ in chain] == ngram_lookup(tokens, max_nodes, max_n, min_n)
    assert [p for _, p in chain] == list(range(len(chain)))


def test_ngram_tree_branches_best_first():
    # (1, 2) went on with 7, 7, 9: the 7 path has support 2 and goes first, as the chain
    # does; then the support-1 nodes, latest occurrence first: the 9 branch off the root (the
    # occurrence at 8), its path, then the 9 after "7 1 2" (the occurrence at 5).
    tokens = [1, 2, 7, 1, 2, 7, 1, 2, 9, 1, 2]
    tree = ngram_tree(tokens, 8, max_n=2, topk=2)
    assert tree == [(7, 0), (1, 1), (2, 2), (9, 0), (1, 4), (2, 5), (9, 3), (1, 7)]
    assert ngram_lookup(tokens, 5, max_n=2) == [7, 1, 2, 9, 1]
    assert ngram_tree(tokens, 3, max_n=2, topk=2) == tree[:3]
    assert ngram_tree([1, 2, 3, 4], 4, max_n=2, topk=2) == []


# ---- oracle trees and the host default ----------------------------------------------------------


def test_oracle_tree_carries_the_truth_at_the_branch():
    truth = {(1, 2): [10, 20, 30]}
    oracle = OracleDrafter(truth, 100, branch=lambda p: p)
    request = Request("r", [1, 2], GREEDY)
    # Depth 1: truth at sibling 0; depth 2 at sibling 1, under node 1; depth 3 trimmed to
    # two siblings, so the truth goes to the last of them, under node 5.
    assert oracle.propose_tree_tokens(request, 8, 3) == [
        (10, 0), (11, 0), (12, 0), (21, 1), (20, 1), (22, 1), (31, 5), (30, 5),
    ]  # fmt: skip
    request.output_token_ids = [10]
    assert oracle.propose_tree_tokens(request, 4, 2) == [(21, 0), (20, 0), (31, 2), (30, 2)]
    wrong = OracleDrafter(truth, 100, wrong=lambda p: p == 1, branch=lambda p: 1)
    # No sibling holds a wrong position's truth, and nothing goes on below it.
    assert wrong.propose_tree_tokens(request, 8, 3) == [(21, 0), (22, 0), (23, 0)]
    assert oracle.propose_tree_tokens(Request("u", [5], GREEDY), 4, 2) == []


class _ChainOnly(Drafter):
    def propose_tokens(self, request, max_drafts):
        return [7, 8, 9][:max_drafts]


def test_host_trees_pack_into_the_window_layout():
    oracle = OracleDrafter({(1,): [4, 5, 6]}, 50, branch=lambda p: 1)
    requests = [Request("a", [1], GREEDY), Request("b", [2], GREEDY), Request("c", [1], GREEDY)]
    batch = Batch(*(np.zeros(4, np.int32) for _ in range(4)))  # only its rows count
    drafts, parents, num = oracle.propose_tree(requests, [5, 3, 0], batch, 6, 2)
    assert num.tolist() == [5, 0, 0, 0]
    assert drafts[0].tolist() == [5, 4, 6, 5, 6, 0] and drafts[1:].max() == 0
    assert parents[0].tolist() == [0, 0, 2, 2, 4, 5]  # node 6 is padding: parent 5
    assert (parents[1:] == np.arange(6)).all()
    tokens = [1, 2, 7, 1, 2, 7, 1, 2, 9, 1, 2]
    drafts, parents, num = NgramDrafter(2, 1).propose_tree(
        [Request("n", tokens, GREEDY)], [5], batch, 6, 2
    )
    tree = ngram_tree(tokens, 5, 2, 1, topk=2)
    assert num[0] == 5 and [(int(t), int(q)) for t, q in zip(drafts[0], parents[0])][:5] == tree
    # A drafter without a tree of its own drafts its chain.
    drafts, parents, num = _ChainOnly().propose_tree(requests[:1], [2], batch, 3, 4)
    assert drafts[0].tolist() == [7, 8, 0] and parents[0].tolist() == [0, 1, 2]
    assert num.tolist() == [2, 0, 0, 0]


# ---- draft-model trees --------------------------------------------------------------------------

LAYOUT = CacheLayout(num_pages=40, page_size=4, max_num_seqs=4, num_checkpoint_slots=3)
PAGES = 8  # per row: 32 tokens
WIDTH = 32  # the reference prefills' padded width (one program)


@pytest.fixture(scope="module")
def models():
    return {
        "kda": for_serving(random_model(preset("tiny"), seed=3)),
        "attention": for_serving(
            random_model(
                preset("tiny", num_hidden_layers=2, kda_layers=(), full_attn_layers=(1, 2)),
                seed=4,
            )
        ),
    }


def _table(rows: int) -> np.ndarray:
    return 1 + np.arange(rows * PAGES, dtype=np.int32).reshape(rows, PAGES)


def _prefilled(model, sequences, lookup=None):
    """A draft whose rows 0.. (slots 1..) prefilled `sequences`."""
    drafter = DraftModelDrafter(model, LAYOUT, lookup=lookup, lookup_tokens=5 if lookup else 0)
    rows = len(sequences)
    ids = np.zeros((rows, WIDTH), np.int32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    slots = np.arange(1, rows + 1, dtype=np.int32)
    lengths = np.array([len(s) for s in sequences], np.int32)
    batch = Batch(slots, _table(rows), np.zeros(rows, np.int32), lengths)
    drafter.prefill(ids, batch, slots, has_prefix=False)
    return drafter


def _decode_batch(prompts, live) -> Batch:
    """Rows after their prompts, one token each; rows not `live` are padding."""
    rows = len(prompts)
    start = np.array([len(p) for p in prompts], np.int32)
    slots = np.where(live, np.arange(1, rows + 1), 0).astype(np.int32)
    table = np.where(np.asarray(live)[:, None], _table(rows), 0).astype(np.int32)
    return Batch(slots, table, np.where(live, start, 0), np.asarray(live, np.int32))


PROMPTS = [[3, 9, 14, 2, 7, 7, 30, 5, 1], [40, 41, 8, 2, 11, 90], [5, 6, 7, 5, 6, 8], [1]]
FIRST = [17, 23, 50, 0]  # each row's last token: its first output


def test_draft_model_tree_holds_its_top_k_after_the_chain(models):
    """Node tokens at each depth are the draft's top-k after prompt + last + the chain so
    far, best first, the chain token first; rows cut at their max_nodes."""
    model, topk, n = models["kda"], 3, 7
    drafter = _prefilled(model, PROMPTS[:3])
    requests = [Request(i, p, GREEDY, [f]) for i, (p, f) in enumerate(zip(PROMPTS, FIRST))]
    batch = _decode_batch(PROMPTS, [True, True, True, False])
    drafts, parents, num = drafter.propose_tree(requests[:3], [7, 4, 0], batch, n, topk)
    drafts, parents, num = np.asarray(drafts), np.asarray(parents), np.asarray(num)
    assert num.tolist() == [7, 4, 0, 0]
    assert parents[0].tolist() == [0, 0, 0, 1, 1, 1, 4]
    assert parents[1].tolist() == [0, 0, 0, 1, 4, 5, 6] and (parents[2:] == np.arange(n)).all()
    assert drafts[1, 4:].max() == 0 and drafts[2:].max() == 0
    for row in (0, 1):
        nodes = [(int(t), int(p)) for t, p in zip(drafts[row], parents[row])][: num[row]]
        assert_tree(nodes, n, topk)
        context = PROMPTS[row] + [FIRST[row]]
        for depth in range(-(-num[row] // topk)):
            level = drafts[row, depth * topk : min((depth + 1) * topk, num[row])]
            # Causal: padding after the context leaves its logits as they are (one program).
            ids = jnp.asarray([context + [0] * (WIDTH - len(context))])
            logits = np.asarray(forward(drafter.graphdef, drafter.params, ids))
            best = np.argsort(-logits[0, len(context) - 1])[: len(level)]
            assert level.tolist() == best.tolist(), (row, depth)
            context.append(int(level[0]))  # the chain goes on from the top-1


def _states_equal(got, want, slot_got, slot_want, label):
    for layer, (g, w) in enumerate(zip(got.kda, want.kda, strict=True)):
        for name, a, b in zip(g._fields, g, w, strict=True):
            np.testing.assert_allclose(
                np.asarray(a[slot_got]), np.asarray(b[slot_want]), rtol=1e-4, atol=1e-5,
                err_msg=f"{label}: layer {layer} {name}",
            )  # fmt: skip


def _latents_equal(got, want, row, length, label):
    """The latent rows of positions [0, length) of row `row` (its pages in both caches)."""
    pages = _table(row + 1)[row]
    for layer, (g, w) in enumerate(zip(got.mla, want.mla, strict=True)):
        at = [(pages[p // LAYOUT.page_size], p % LAYOUT.page_size) for p in range(length)]
        a = np.stack([np.asarray(g.latent[pg, o]) for pg, o in at])
        b = np.stack([np.asarray(w.latent[pg, o]) for pg, o in at])
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{label}: mla {layer}")


@pytest.mark.parametrize("looked_up", [True, False])
@pytest.mark.parametrize("kind", ["kda", "attention"])
def test_rollback_tree_leaves_exactly_the_accepted_path(models, kind, looked_up):
    """Rows end on a sibling leaf (A), at the chain's end (B) and on a non-first branch of a
    lookup tree (L; without lookup, on the model's last sibling at depth 1); the fourth is
    padding. Afterwards each row's KDA state, conv windows and latent rows equal those of a
    draft that prefilled prompt + last + the accepted drafts, and the track slots the state
    after their track step (in the tail for A, inside the chain for B, in the lookup
    catch-up or the tail for L)."""
    model, topk, n = models[kind], 3, 7
    truth = {tuple(PROMPTS[2]): [FIRST[2], 60, 61, 62]}
    lookup = OracleDrafter(truth, model.config.vocab_size, branch=lambda p: 1)
    drafter = _prefilled(model, PROMPTS[:3], lookup if looked_up else None)
    requests = [Request(i, p, GREEDY, [f]) for i, (p, f) in enumerate(zip(PROMPTS, FIRST))]
    batch = _decode_batch(PROMPTS, [True, True, True, False])
    drafts, parents, num = drafter.propose_tree(requests[:3], [7, 7, 7], batch, n, topk)
    drafts, parents = np.asarray(drafts), np.asarray(parents)
    assert num.tolist() == [7, 7, 5 if looked_up else 7, 0]
    if looked_up:
        assert drafts[2, :5].tolist() == [61, 60, 62, 62, 61] and parents[2, 3] == 2
    # Node paths: A c_1 then its depth-2 sibling (node 5); B c_1 c_2 c_3; L nodes 2 and 5
    # of the lookup's tree, or the model's third depth-1 node.
    paths = {0: [1, 5], 1: [1, 4, 7], 2: [2, 5] if looked_up else [3]}
    window = np.zeros((4, n + 1), np.int32)
    commit_lens = np.zeros(4, np.int32)
    for row, nodes in paths.items():
        assert all(parents[row, b - 1] == a for a, b in zip([0, *nodes], nodes))
        accepted = [FIRST[row], *(int(drafts[row, j - 1]) for j in nodes)]
        window[row, : len(accepted)] = accepted
        commit_lens[row] = len(accepted)
    tracked = kind == "kda"
    track_slots = np.array([5, 6, 7, -1], np.int32)
    track_steps = np.array([2, 1, 1, -1], np.int32)
    track = (track_slots, track_steps) if tracked else None
    drafter.rollback_tree(batch.slots, jnp.asarray(window), jnp.asarray(commit_lens), track)
    sequences = [PROMPTS[r] + window[r, : commit_lens[r]].tolist() for r in range(3)]
    want = _prefilled(model, sequences)
    for row, s in enumerate(sequences):
        _latents_equal(drafter.cache, want.cache, row, len(s), f"row {row}")
        if tracked:
            _states_equal(drafter.cache, want.cache, row + 1, row + 1, f"row {row}")
    if tracked:
        upto = [PROMPTS[r] + window[r, : track_steps[r] + 1].tolist() for r in range(3)]
        at_track = _prefilled(model, upto)
        for row in range(3):
            _states_equal(drafter.cache, at_track.cache, track_slots[row], row + 1, f"track {row}")
