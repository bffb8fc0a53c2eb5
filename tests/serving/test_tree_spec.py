"""Tree verification: acceptance over a draft tree against a walk of the tree, the law of tree
rejection sampling (the target's, exactly), the committed state of an accepted non-first branch
against plain decoding of its tokens (state, conv windows, latent rows, track point), and
engines with draft trees: greedy output equals plain greedy (one device, DCP 4, prefix cache
on), sampled output equals plain sampled with the same seed, preemption and abort inside
trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.cache import Batch
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingBatch, SamplingParams
from serving.speculative.tree_verify import tree_accept, verify_tree_step
from tests.serving.test_speculative import _copy, _plain, _setup

# A tree of 6 nodes: 0 the root; 1, 2 its children; 3 under 2; 4 under 3; 5 under 1.
PARENTS = [-1, 0, 0, 2, 3, 1]


def _walk(ids, parents, targets, num_nodes):
    """The accepted path by a walk from the root: follow the child holding the target's token
    after the current node, while there is one."""
    path, node = [0], 0
    while True:
        children = [i for i in range(1, num_nodes) if parents[i] == node]
        nxt = [c for c in children if ids[c] == targets[node]]
        if not nxt:
            return path
        node = nxt[0]
        path.append(node)


def test_greedy_tree_accept_follows_the_walk():
    rng = np.random.default_rng(0)
    v, t = 5, len(PARENTS)
    for trial in range(300):
        logits = rng.normal(size=(1, t, v)).astype(np.float32)
        targets = logits[0].argmax(-1)
        ids = rng.integers(0, v, t)
        # Make some children match their parent's target, so that paths get deep.
        for i in range(1, t):
            if rng.random() < 0.6:
                ids[i] = targets[PARENTS[i]]
        if ids[1] == ids[2]:  # siblings distinct
            ids[2] = (ids[1] + 1) % v
        num = int(rng.integers(1, t + 1))
        sampling = SamplingBatch.from_params([SamplingParams(temperature=0, seed=0)], [0], 1)
        tokens, path, accept, lens = tree_accept(
            jnp.asarray(logits),
            jnp.asarray([ids], jnp.int32),
            jnp.asarray([PARENTS], jnp.int32),
            jnp.asarray([num]),
            sampling,
            sample=False,
        )
        want = _walk(ids.tolist(), PARENTS, targets.tolist(), num)
        d = len(want)
        assert int(lens[0]) == d, trial
        assert path[0, :d].tolist() == want and int(accept[0]) == want[-1]
        assert tokens[0, :d].tolist() == [int(targets[n]) for n in want]


def test_tree_rejection_sampling_keeps_the_target_law():
    """Many rows (seeds) over one tree and one set of logits: the first emitted token has the
    root's law, the second the law of the node the first led to (a child holding it), the third
    likewise; a first token no child holds ends the window."""
    v, n = 5, 40_000
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(len(PARENTS), v)).astype(np.float32)
    logits[0, 3] += 2.0  # make the path 0 -> 2 -> 3 likely, so its third token has a sample
    logits[2, 2] += 2.0
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ids = np.array([0, 1, 3, 2, 4, 0])  # node tokens; the root's is irrelevant
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    sampling = SamplingBatch.from_params(params, [0] * n, n)
    tokens, path, _, lens = tree_accept(
        jnp.broadcast_to(jnp.asarray(logits), (n, len(PARENTS), v)),
        jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (n, len(PARENTS))),
        jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (n, len(PARENTS))),
        jnp.full((n,), len(PARENTS)),
        sampling,
        sample=True,
    )
    tokens, lens = np.asarray(tokens), np.asarray(lens)
    child = {0: {1: 1, 3: 2}, 1: {0: 5}, 2: {2: 3}, 3: {4: 4}}  # node -> token -> child

    # The law of (x1, x2): x2 follows only when x1 led to a child.
    law: dict[tuple, float] = {}
    for x1 in range(v):
        node = child[0].get(x1)
        if node is None:
            law[(x1,)] = p[0, x1]
            continue
        for x2 in range(v):
            law[(x1, x2)] = p[0, x1] * p[node, x2]
    seen: dict[tuple, int] = {}
    for row, m in zip(tokens, lens):
        key = (row[0],) if m == 1 else (row[0], row[1])
        seen[key] = seen.get(key, 0) + 1
    assert set(seen) <= set(law)
    tv = 0.5 * sum(abs(seen.get(k, 0) / n - q) for k, q in law.items())
    assert tv < 0.02, tv
    # Third token after the path 0 -> 2 -> 3 (x1 = 3, x2 = 2): node 3's law.
    deep = tokens[(lens >= 3) & (tokens[:, 0] == 3) & (tokens[:, 1] == 2)][:, 2]
    freq = np.bincount(deep, minlength=v) / len(deep)
    assert len(deep) > 1000 and 0.5 * np.abs(freq - p[3]).sum() < 0.05


# ---- the committed state ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


def test_accepted_branch_commits_the_plain_state(model):
    """The true greedy continuation sits on the second child of the root (the first child is
    wrong) and two levels down: the slot's state and conv windows, the latent rows at the next
    positions, and the track slot (path step 1) equal plain decoding of those tokens."""
    graphdef, params, cache, table, n, first = _setup(model)
    seq, c = [first], _copy(cache)
    for i in range(4):
        nxt, c = _plain(graphdef, params, c, table, n + i, [seq[-1]])
        seq.append(nxt[0])
    vocab = model.config.vocab_size
    wrong = (seq[1] + 1) % vocab
    # nodes: 1 wrong (child of root), 2 = seq[1] (child of root), 3 = seq[2] under 2,
    # 4 = wrong under 1, 5 = seq[3] under 3.
    drafts = [wrong, seq[1], seq[2], (seq[2] + 3) % vocab, seq[3]]
    parents = [0, 0, 2, 1, 3]
    batch = Batch(jnp.asarray([1]), table, jnp.asarray([n]), jnp.asarray([1]))
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0, seed=0)], [0], 1)
    counts, mask = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), bool)
    (tokens, lens, *_), accepted, depth, got = verify_tree_step(
        graphdef,
        params,
        jnp.asarray([first]),
        jnp.asarray([drafts], jnp.int32),
        jnp.asarray([parents], jnp.int32),
        jnp.asarray([len(drafts)]),
        _copy(cache),
        batch,
        sampling,
        counts,
        mask,
        jnp.asarray([2]),
        jnp.asarray([1]),
        mode="greedy",
        track=True,
    )
    assert int(lens[0]) == 4 and int(depth[0]) == 3
    assert tokens[0, :4].tolist() == seq[1:5]
    assert accepted[0, :4].tolist() == seq[:4]
    _, want = _plain(graphdef, params, _copy(cache), table, n, seq[:4])
    _, want_track = _plain(graphdef, params, _copy(cache), table, n, seq[:2])
    for g, w, wt in zip(got.kda, want.kda, want_track.kda, strict=True):
        for name, a, b, bt in zip(g._fields, g, w, wt, strict=True):
            np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(a[2], bt[1], rtol=1e-5, atol=1e-6, err_msg=name)
    for g, w in zip(got.mla, want.mla, strict=True):  # positions n .. n + 3: page 2, rows 4-7
        np.testing.assert_allclose(g.latent[2, 4:8], w.latent[2, 4:8], rtol=1e-5, atol=1e-6)
    # A plain step after the tree equals one after plain decoding.
    after, _ = _plain(graphdef, params, got, table, n + 4, [seq[4]])
    again, _ = _plain(graphdef, params, want, table, n + 4, [seq[4]])
    assert after == again


# ---- engines with draft trees ------------------------------------------------------------------

from serving.engine import LLM  # noqa: E402
from serving.speculative.oracle import OracleDrafter  # noqa: E402

PROMPTS = [list(range(3, 59)), list(range(60, 116)), list(range(130, 186))]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
SHAPES = dict(
    num_pages=64,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(64,),
    max_num_batched_tokens=64,
    chunk_size=16,
)


class BranchOracle(OracleDrafter):
    """A tree whose true path is never the first child: at each depth a wrong sibling comes
    first, then the true token, whose children come next. `wrong(position)` replaces the true
    token too (the path ends there)."""

    def propose_tree_tokens(self, request, max_nodes: int, topk: int):
        truth = self.continuations.get(tuple(request.prompt_token_ids))
        if truth is None:
            return []
        done, nodes, parent = len(request.output_token_ids), [], 0
        for position in range(done, len(truth)):
            token = truth[position]
            if self.wrong(position):
                token = (token + 2) % self.vocab_size
            nodes.append(((token + 1) % self.vocab_size, parent))  # the wrong first child
            nodes.append((token, parent))
            parent = len(nodes)
            if len(nodes) >= max_nodes:
                break
        return nodes[:max_nodes]


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, **SHAPES)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _tree_llm(model, reference, wrong, **kw):
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    drafter = BranchOracle(truth, model.config.vocab_size, wrong)
    spec = {"method": "ngram", "num_draft_tokens": 6, "topk": 2, "min_acceptance": 0}
    return LLM(model, speculative=spec, drafter=drafter, **{**SHAPES, **kw})


def _drained(llm):
    assert llm.cache.allocator.num_free == llm.cache.allocator.capacity - (
        llm.cache.allocator.num_tree_pages
    )


@pytest.mark.parametrize("dcp", [1, 4])
def test_tree_greedy_equals_plain_with_prefix_cache(model, plain, reference, dcp):
    """Trees whose accepted paths run down second children, windows cut short every fifth
    token, through a track point (64) and a prefix hit on it afterwards."""
    llm = _tree_llm(model, reference, lambda p: p % 5 == 3, dcp_size=dcp)
    assert llm.cache.prefix_cache is not None and llm.track_interval == 64
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in out] == reference
    m = llm.metrics()
    assert m["spec_accepted_tokens"] > 0 and m["spec_draft_tokens"] > m["spec_accepted_tokens"]
    longer = PROMPTS[0] + out[0].token_ids
    (again,) = llm.generate([longer], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 64  # the checkpoint a tree window snapshotted
    assert again.token_ids == plain.generate([longer], GREEDY, use_tqdm=False)[0].token_ids
    llm.reset_prefix_cache()
    _drained(llm)


def test_tree_sampled_text_equals_plain_with_the_same_seeds(model, plain):
    params = [SamplingParams(temperature=0.9, top_k=20, seed=s, max_tokens=10) for s in (1, 2, 3)]
    want = [o.token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    # The oracle's truth is the sampled text: its trees hold every sampled token.
    llm = _tree_llm(model, want, lambda p: False)
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert llm.metrics()["spec_accepted_tokens"] > 0


def test_tree_preemption_and_abort(model, reference):
    """Few pages: requests are preempted between tree windows and recompute; one request is
    aborted mid-run. The others' text stays plain's and every page comes back."""
    llm = _tree_llm(model, reference, lambda p: p % 4 == 1, num_pages=40)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS + PROMPTS]
    outs, steps = {}, 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        if steps == 6:
            assert llm.abort_request(ids[1])
    assert llm.metrics()["preemptions"] > 0
    for i, rid in enumerate(ids):
        if rid == ids[1]:
            assert outs[rid].finish_reason == "abort"
        else:
            assert outs[rid].token_ids == reference[i % 3], i
    llm.reset_prefix_cache()
    _drained(llm)


def _perturbed(model, scale: float):
    """The model with noise on every float weight: a draft that agrees with it often but not
    always, so that its second choices get accepted too."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    noisy = [
        x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1
        else x
        for x, k in zip(leaves, keys, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def test_ngram_and_draft_model_trees_equal_plain(model, plain):
    """The drafters' own trees: n-gram candidates on repetitive prompts, and a random draft
    model's top-2 at each depth (its chain and siblings, some accepted)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # The model's own continuations as prompts: a random model's greedy text falls into loops,
    # which prompt lookup then drafts (the prompts' own patterns it does not continue).
    first = plain.generate([p[:20] for p in PROMPTS], params, use_tqdm=False)
    prompts = [p[:20] + o.token_ids for p, o in zip(PROMPTS, first, strict=True)]
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    draft = _perturbed(model, 0.05)
    for spec in (
        {"method": "ngram", "num_draft_tokens": 6, "topk": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": draft, "num_draft_tokens": 6, "topk": 2},
    ):
        llm = LLM(model, speculative={**spec, "min_acceptance": 0}, **SHAPES)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        m = llm.metrics()
        assert m["spec_draft_tokens"] > m["spec_accepted_tokens"] > 0, (spec["method"], m)
        llm.reset_prefix_cache()
        _drained(llm)
