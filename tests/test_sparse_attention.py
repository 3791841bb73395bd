"""chunkcache.blend.attention.attend: queries at arbitrary positions see exactly the keys at or before their position."""

import pytest
import torch

from chunkcache.blend import attention
from chunkcache.blend.attention import QUERY_BLOCK, STAIR_LEAF, attend, plan_blocks


def dense(q, keys, values, q_pos, k_pos, scale, window=None):
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("mhd,chd->hmc", q, k) * scale
    visible = k_pos[None, None, :] <= q_pos[None, :, None]
    if window is not None:  # SGLang's sliding_window_size: keys q - window .. q
        visible &= k_pos[None, None, :] >= q_pos[None, :, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hmc,chd->mhd", scores.softmax(-1), v)


def test_blocks_over_ordered_and_unordered_keys_match_dense_attention():
    torch.manual_seed(0)
    m = 3 * QUERY_BLOCK + 5  # several query blocks
    n = 2 * m
    q_pos = torch.randperm(n)[:m].sort().values
    q, keys, values = torch.randn(m, 6, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    ordered = torch.arange(n)
    torch.testing.assert_close(attend(q, keys, values, q_pos, ordered, 0.2), dense(q, keys, values, q_pos, ordered, 0.2))
    shuffled = torch.randperm(n)  # e.g. a standalone chunk: prefix keys then its own fresh keys
    torch.testing.assert_close(attend(q, keys, values, q_pos, shuffled, 0.2),
                               dense(q, keys, values, q_pos, shuffled, 0.2))
    record = torch.zeros(n)
    attend(q, keys, values, q_pos, ordered, 0.2, record)
    assert torch.allclose(record.sum(), torch.tensor(1.0), atol=1e-4)  # mean attention over queries and heads


def test_a_sliding_window_hides_keys_further_back_than_the_window():
    torch.manual_seed(2)
    m, n, window = 3 * QUERY_BLOCK + 5, 900, 37
    q_pos = torch.cat([torch.randperm(n - 10)[: m - 10].sort().values, torch.arange(n - 10, n)])
    q, keys, values = torch.randn(m, 6, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    for k_pos in (torch.arange(n), torch.randperm(n)):  # ordered (range per block) and unordered (mask only)
        want = dense(q, keys, values, q_pos, k_pos, 0.2, window)
        torch.testing.assert_close(attend(q, keys, values, q_pos, k_pos, 0.2, window=window), want)
        assert (want - dense(q, keys, values, q_pos, k_pos, 0.2)).abs().max() > 0.1  # the window changes the answer
    record = torch.zeros(n)  # the query tail alone: no key more than `window` behind its first row is attended
    attend(q[-10:], keys, values, q_pos[-10:], torch.arange(n), 0.2, record, window=window)
    assert record[: n - 10 - window].sum() == 0 and abs(record.sum().item() - 1) < 1e-4


def test_the_staircase_covers_each_rows_visible_keys_exactly_once():
    """Every (row, key) pair with key <= the row's position is in exactly one tile (unmasked, or masked-in), every
    other pair in none; each row's first tile is marked first, and no tile leaves a row with nothing to attend."""
    torch.manual_seed(3)
    n = 3000
    for m in (1, STAIR_LEAF, 5 * STAIR_LEAF + 3):
        q_pos = torch.cat([torch.randperm(n - 20)[: max(m - 20, 1)].sort().values, torch.arange(n - 20, n)])[-m:]
        covered = torch.zeros(len(q_pos), n, dtype=torch.int)
        seen = torch.zeros(len(q_pos), dtype=torch.bool)
        for t in plan_blocks(q_pos, torch.arange(n), False).tiles:
            visible = torch.ones(t.rows.stop - t.rows.start, t.keys.stop - t.keys.start, dtype=torch.bool)
            if t.mask is not None:
                visible = t.mask
            assert visible.any(1).all()
            assert bool(seen[t.rows].any()) != t.first and bool(seen[t.rows].all()) != t.first
            seen[t.rows] = True
            covered[t.rows, t.keys] += visible.int()
        assert torch.equal(covered, (torch.arange(n)[None] <= q_pos[:, None]).int())


@pytest.mark.parametrize("kernel", ["flash", "gemm"])
@pytest.mark.parametrize("amplitude,scale", [(1, 0.125), (3, 0.125), (3, 0.11)])  # 0.11: scaled after the product
def test_bfloat16_blocks_are_as_accurate_as_one_sdpa_call_per_query(amplitude, scale, kernel, monkeypatch):
    """On CPU, bf16 attention runs either kernel (the host's faster, attention.bf16_kernel): flash attention over
    the staircase is SDPA's own bf16 kernel; bf16 matmuls round their scores to bf16, and each row's shift keeps the
    scores that carry weight near 0, so even scores of ~16 (queries amplified 3x, and a sink key every query scores
    highly) stay as close to float64 as SDPA's bf16 flash kernel called per query. Without the shift the error at 3x
    is 2.7 times SDPA's."""
    monkeypatch.setattr(attention, "bf16_kernel", lambda: kernel)
    torch.manual_seed(1)
    m, n = 2 * QUERY_BLOCK + 7, 2000
    q_pos = torch.cat([torch.randperm(n - 20)[: m - 20].sort().values, torch.arange(n - 20, n)])  # + a query tail
    q, keys, values = (torch.randn(r, h, 64) for r, h in ((m, 9), (n, 3), (n, 3)))
    q *= amplitude
    keys[0] = q.view(m, 3, 3, 64).mean((0, 2)) * 3
    ordered = torch.arange(n)
    want = dense(q.double(), keys.double(), values.double(), q_pos, ordered, scale)
    bf = [t.bfloat16() for t in (q, keys, values)]
    blocks = attend(*bf, q_pos, ordered, scale).double()
    one_call = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        bf[0][i: i + 1].transpose(0, 1), bf[1][: p + 1].transpose(0, 1), bf[2][: p + 1].transpose(0, 1), scale=scale,
        enable_gqa=True).transpose(0, 1) for i, p in enumerate(q_pos.tolist())]).double()
    blocks_err, one_err = (blocks - want).abs().max().item(), (one_call - want).abs().max().item()
    assert blocks_err <= 1.25 * one_err + 1e-3, (blocks_err, one_err)
