"""sparse_attention.attend: queries at arbitrary positions see exactly the keys at or before their position."""

import torch

from sglang_patch.sparse_attention import QUERY_BLOCK, attend


def dense(q, keys, values, q_pos, k_pos, scale):
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("mhd,chd->hmc", q, k) * scale
    scores = scores.masked_fill(~(k_pos[None, None, :] <= q_pos[None, :, None]), float("-inf"))
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
