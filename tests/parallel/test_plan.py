"""The memory planner against hand arithmetic on the release's shapes (Kimi-Linear-48B-A3B:
27 layers = 20 KDA + 7 MLA, hidden 2304, vocab 163,840, 32 heads of 128, kv_lora_rank 512 +
rope 64, 256 experts of 1024 plus one shared, a dense first layer of 9216), bf16 weights and
latents, fp32 KDA state. Abstract: nothing is allocated."""

from __future__ import annotations

import pytest

from kimi_linear_jax.parallel.plan import parse_bytes, plan_memory
from kimi_linear_jax.presets import preset

RELEASE = preset("kimi-linear-48b-a3b")
BF16, F32 = 2, 4
GB, GiB, MiB = 10**9, 2**30, 2**20
SETS = [(1, 1), (4, 1), (4, 4), (8, 1), (8, 4), (8, 8)]  # (tp, dcp): tp 1/4/8, dcp 1/4/8


def release_weights_per_device(tp: int) -> int:
    """Bytes of the release's parameters on one device, from the sharding rules written out:
    heads, experts, vocab and MLP widths split over tp; norms, routers, the KDA f_a/g_a
    down-projections and the MLA kv_a projection whole on every device."""
    D, V = 2304, 163840
    sharded = 2 * V * D * BF16  # embedding and lm_head (vocab rows)
    sharded += 3 * 9216 * D * BF16  # layer 0's dense MLP
    sharded += 26 * (3 * 256 * 1024 * D + 3 * 1024 * D) * BF16  # routed + shared experts
    kda = (3 * 4096 * D + D * 4096 + 32 * D + 2 * 4096 * 128 + 3 * 4096 * 4) * BF16
    kda += (4096 + 32) * F32  # dt_bias, A_log
    sharded += 20 * kda
    sharded += 7 * (32 * 192 * D + 32 * 256 * 512 + D * 4096) * BF16  # q, kv_b, o
    replicated = (2 * 27 + 1) * D * BF16  # layer norms and the final norm
    replicated += 26 * (256 * D * BF16 + 256 * F32)  # router weight and correction bias
    replicated += 20 * (2 * 128 * D + 128) * BF16  # f_a, g_a, o_norm
    replicated += 7 * (576 * D + 512) * BF16  # kv_a_proj_with_mqa, kv_a_layernorm
    return sharded // tp + replicated


def release_state_per_slot(tp: int) -> int:
    # 20 KDA layers x (S: 32/tp heads x 128 x 128 fp32 + 3 conv windows of 3 x 4096/tp bf16)
    return 20 * (32 // tp * 128 * 128 * F32 + 3 * 3 * 4096 // tp * BF16)


def plan(mem="80GB", tp=8, dcp=8, **kw):
    kw.setdefault("max_model_len", 131072)
    return plan_memory(RELEASE, device_memory=mem, tensor_parallel_size=tp, dcp_size=dcp, **kw)


def test_hand_weights_total_is_the_release():
    # 49.1 B parameters, 98.2 GB in bf16 (reference/parallelism.md)
    assert release_weights_per_device(1) == 98_245_541_888


@pytest.mark.parametrize(("tp", "dcp"), SETS, ids=[f"tp{t}-dcp{c}" for t, c in SETS])
def test_release_bytes_per_device(tp, dcp):
    p = plan("141GB", tp, dcp)
    assert p.weights_bytes_per_device == release_weights_per_device(tp)
    assert p.kv_bytes_per_token_per_device == 7 * 576 * BF16 / dcp  # 8,064 B / dcp
    assert p.state_bytes_per_slot_per_device == release_state_per_slot(tp)
    assert p.tokens_per_page == 16 * dcp
    if p.fits:
        # The pools it hands out, counted from its own counts.
        page = 16 * 7 * 576 * BF16  # a device's share of a page: 16 tokens of 8,064 B
        assert p.cache_bytes_per_device == (
            p.num_pages * page + p.num_state_slots * release_state_per_slot(tp)
        )
        assert p.max_tokens_in_cache == (p.num_pages - 1) * 16 * dcp


def test_state_per_slot_matches_the_reference_figure():
    assert release_state_per_slot(1) == 43_417_600  # 40 MiB of S + 1.4 MiB of windows
    assert round(release_state_per_slot(1) / MiB, 1) == 41.4


def test_release_does_not_fit_one_80gb_device():
    p = plan("80GB", 1, 1)
    assert not p.fits
    assert "weights 91.50 GiB" in p.reason and "exceed the budget 67.06 GiB" in p.reason
    assert (p.num_pages, p.num_state_slots, p.max_num_seqs) == (0, 0, 0)


def test_release_on_8x80gb_uses_the_budget():
    p = plan("80GB", 8, 8)
    assert p.fits and p.reason is None
    # max_num_seqs at vLLM's cap of 256; 2 checkpoint slots each and the null slot.
    assert (p.max_num_seqs, p.num_checkpoint_slots, p.num_state_slots) == (256, 512, 769)
    used = p.weights_bytes_per_device + p.activation_bytes + p.cache_bytes_per_device
    budget = int(80 * GB * 0.9)
    assert p.budget_bytes == budget
    # Everything but less than one page of the budget is handed out.
    assert 0 <= budget - used < 16 * 8064


def test_split_follows_the_state_ratio():
    """With a measured activation (no per-row estimate) the state share is rest * r / (1 + r)
    and each sequence costs 3 slots (its own and 2 checkpoints), the null slot one more."""
    tiny = preset("tiny")  # 3 KDA layers of 4 heads x 8 x 8, one MLA layer of 32 + 8
    slot = 3 * (4 * 8 * 8 * F32 + 3 * 3 * 32 * F32)
    page = 4 * 40 * F32
    weights, act, r = 1_000_000, 500_000, 0.5
    p = plan_memory(
        tiny,
        device_memory=20_000_000,
        dtype="float32",
        page_size=4,
        max_model_len=64,
        max_num_seqs=10**6,
        weights_bytes=weights,
        activation_bytes=act,
        state_memory_ratio=r,
    )
    rest = 18_000_000 - weights - act
    share = int(rest * r / (1 + r))
    seqs = (share - slot) // (3 * slot)
    assert p.max_num_seqs == seqs
    assert p.num_pages == (rest - (1 + 3 * seqs) * slot) // page


def test_unused_state_goes_to_pages():
    few, many = plan(max_num_seqs=8), plan()
    assert few.max_num_seqs == 8
    saved = (many.max_num_seqs - 8) * 3 * release_state_per_slot(8)
    assert few.num_pages > many.num_pages + saved // (16 * 8064) - 1


def test_long_context_that_does_not_fit_says_why():
    p = plan("80GB", 8, 1, max_model_len=100_000_000)
    assert not p.fits and "100000000-token sequence" in p.reason


def test_speculation_adds_the_verify_window():
    """k drafts: the replay commit's per-step inputs of the k + 1 window tokens per row (20 KDA
    layers x 5 tokens x (3 pre-conv projections [4096/8] bf16 + k, g, v [32/8, 128] and beta
    [32/8] fp32)), and sampling over k more positions."""
    plain, spec = plan(), plan(num_draft_tokens=4)
    replay = 20 * 5 * (3 * 512 * BF16 + (3 * 4 * 128 + 4) * F32)
    assert spec.verify_bytes_per_seq == replay
    assert spec.seq_bytes_per_device - plain.seq_bytes_per_device == replay + 4 * 163840 * 17


def test_replicated_draft_pool_counts_dcp_times():
    """`small` (6 heads) does not shard over tp 8: its pool sits whole on a device, a virtual
    page of 16 x 8 tokens; `tiny-tp8` (8 heads) shards like the target."""
    small = plan(num_draft_tokens=4, draft_config=preset("small"))
    row = 2 * 576 * BF16  # small: 2 MLA layers
    assert small.draft_replicated is True
    assert small.draft_kv_bytes_per_token_per_device == row  # = (row / dcp) x dcp
    draft_state = 6 * (6 * 128 * 128 * F32 + 3 * 3 * 768 * BF16)
    assert small.draft_state_bytes_per_slot_per_device == draft_state
    page = 16 * 8064 + 16 * 8 * row
    slot = release_state_per_slot(8) + draft_state
    assert small.cache_bytes_per_device == small.num_pages * page + small.num_state_slots * slot
    sharded = plan(num_draft_tokens=4, draft_config=preset("tiny-tp8"))
    assert sharded.draft_replicated is False
    assert sharded.draft_kv_bytes_per_token_per_device == 1 * 40 * BF16 / 8


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("141GB") == 141 * GB
    assert parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes(4096) == 4096


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(mem="80 furlongs"), "cannot read '80 furlongs'"),
        (dict(mem="0GB"), "must be > 0"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        (dict(tp=3, dcp=1), "tensor_parallel_size 3 must divide"),
        (dict(page_size=0), "page_size must be an integer >= 1"),
        (dict(num_draft_tokens=-1), "num_draft_tokens must be"),
        (dict(state_memory_ratio=0), "state_memory_ratio must be"),
        (dict(activation_bytes=10), "needs the max_num_seqs"),
    ],
)
def test_bad_input_names_the_problem(kw, match):
    with pytest.raises(ValueError, match=match):
        plan(**kw)
