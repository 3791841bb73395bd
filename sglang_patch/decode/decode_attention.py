"""CPU attention backend `chunkcache_torch`: SGLang's torch-native backend with a decode step planned once per batch
and attended in float32. Prefill (extend, mixed batches included) is SGLang's own code, untouched.

Why: SGLang's torch-native decode reads each row's KV with a per-layer slice of req_to_token and runs CPU SDPA in
the pool's dtype; with a bfloat16 pool, SDPA on one query row costs 2.7 ms per row per layer at 3.3K keys against
0.95 ms for the same gather upcast to float32 (2-core Zen 4, torch 2.14,
`chunkbench/kernels/decode_attention_bench.py`). Decode is identical work on both sides of an A/B, so its cost only
dilutes what chunk reuse saves in prefill; the launcher selects this backend for both sides.

Plan/run: each row's KV slots are sliced once per step in `init_forward_metadata`; `forward_decode` (per layer)
writes the step's KV, gathers, attends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

NAME = "chunkcache_torch"


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(DecodeAttention)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])


class DecodeAttention(TorchNativeAttnBackend):
    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.row_slots: list[torch.Tensor] | None = None
        if (forward_batch.forward_mode.is_decode() and forward_batch.encoder_lens is None
                and not self.use_sliding_window_kv_pool):
            lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
            table = self.req_to_token_pool.req_to_token
            self.row_slots = [table[r, :n] for r, n in zip(forward_batch.req_pool_indices.tolist(), lens.tolist())]

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if (self.row_slots is None or layer.is_cross_attention
                or (layer.sliding_window_size is not None and layer.sliding_window_size > -1)):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        hq, hk, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.v_head_dim
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        queries = q.reshape(-1, hq, layer.qk_head_dim).float().unsqueeze(2)  # [rows, Hq, 1, D]
        out = q.new_empty(len(self.row_slots), hq, dv)
        for i, slots in enumerate(self.row_slots):
            keys = k_buf[slots].transpose(0, 1).float()  # [Hk, n, D]
            values = v_buf[slots].transpose(0, 1).float()
            out[i] = F.scaled_dot_product_attention(queries[i], keys, values, scale=layer.scaling,
                                                    enable_gqa=hq != hk).squeeze(1)
        return out.view(-1, hq * dv)
