"""GPU attention for the blend passes: FlashInfer's paged prefill with a custom mask (plan once, run per layer).

The pool-writing segments of a pass become one FlashInfer batch: request i's queries (its selected tokens, at
arbitrary positions) against its KV row read in place from the pool (page size 1, no gather), with the mask
`key position <= query position`. A custom mask is needed because FlashInfer's causal mask is bottom-right
aligned: it is exact only for a contiguous run of queries at the end of the KV list. This is the layout SGLang's
EAGLE target-verify uses; FA2 is the only FlashInfer backend with custom masks. Segments that keep their KV aside
(standalone chunks) or record attention stay on the torch path (`chunkcache.blend.attention`).

UNVERIFIED: written without a GPU (see the issue notes); selected only on CUDA devices with flashinfer installed.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

log = logging.getLogger(__name__)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace; SGLang's default size
_workspace: dict[torch.device, torch.Tensor] = {}


def available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


class PagedSparsePrefill:
    """One pass's FlashInfer plan over `segments` (each: q_pos [m] positions, ctx_slots [c] pool slots)."""

    def __init__(self, segments, num_qo_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                 scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device):
        import flashinfer

        if device not in _workspace:
            _workspace[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            log.info("chunkcache: FlashInfer paged prefill with custom mask on %s", device)
        i32 = dict(dtype=torch.int32, device=device)
        qo = torch.tensor([0] + [len(s.q_pos) for s in segments], **i32).cumsum(0, dtype=torch.int32)
        kv = torch.tensor([0] + [len(s.ctx_slots) for s in segments], **i32).cumsum(0, dtype=torch.int32)
        indices = torch.cat([s.ctx_slots for s in segments]).to(**i32)
        mask = torch.cat([(torch.arange(len(s.ctx_slots), device=device)[None, :] <= s.q_pos[:, None]).flatten()
                          for s in segments])
        self.rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in segments]).to(device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace[device], "NHD", backend="fa2")
        self.wrapper.plan(qo, kv, indices, torch.ones(len(segments), **i32), num_qo_heads, num_kv_heads, head_dim,
                          1, head_dim_vo=head_dim_v, custom_mask=mask, sm_scale=scale, q_data_type=q_dtype,
                          kv_data_type=kv_dtype)

    def run(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """Outputs [rows, Hq, Dv] for `self.rows` of the pass's q [n, Hq, D]."""
        return self.wrapper.run(q[self.rows].to(k_buf.dtype), (k_buf, v_buf))
