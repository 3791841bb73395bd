"""The `chunkcache` radix-cache backend (`--radix-cache-backend chunkcache`).

Exact-prefix matching, locking and eviction stay SGLang's UnifiedRadixCache. This class adds what chunk reuse needs
in the scheduler process: the content-hashed chunk store, the selectors, and the accounting. Chunk KV lives in the
store's host/disk tiers (never aliased into the KV pool: blends copy it into each request's own slots), so the pool's
allocation and eviction contract is SGLang's, unchanged. Requests that carry chunks are namespaced in the radix tree
(see plugin._namespace_blended) so their approximate KV can never be matched as an exact prefix by other requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from chunkcache.hashing import model_fingerprint
from chunkcache.rope import RopeSpec
from chunkcache.select import REGISTRY, Selector
from chunkcache.store import ChunkStore, EntryLayout

from . import metrics
from .launcher import BACKEND_NAME, load_server_config

log = logging.getLogger(__name__)
ACTIVE: "ChunkRadixCache | None" = None  # the scheduler process's instance (one tree cache per scheduler)


class ChunkRadixCache(UnifiedRadixCache):
    def __init__(self, params, *, model_config, model_path: str, **kwargs):
        super().__init__(params, **kwargs)
        global ACTIVE
        self.config = load_server_config()
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
        self.rope = RopeSpec.from_config(model_config.hf_config)
        self.fingerprint = model_fingerprint(model_path)
        # disk entries are checked against this model's KV layout when read (a misfit is dropped, not used)
        _, kv_heads, head_dim = self.token_to_kv_pool.get_key_buffer(0).shape
        layout = EntryLayout(self.fingerprint, self.token_to_kv_pool.layer_num, kv_heads, head_dim)
        self.store = ChunkStore.from_config(self.config.store, self.fingerprint, layout)
        self.model_path = model_path
        # tokens one prefill forward may compute: the scheduler's resolved chunked-prefill size (set by
        # admission.adopt_budget once the scheduler has it); None: unbounded
        self.prefill_budget: int | None = None
        self._selectors: dict[str, Selector] = {}
        self._drafts: dict = {}
        self._tokenizer = None
        ACTIVE = self
        log.info("chunkcache: radix cache backend %r active in scheduler pid %d", BACKEND_NAME, os.getpid())

    def selector(self, name: str) -> Selector:
        if name not in self._selectors:
            self._selectors[name] = REGISTRY.create(name, **self.config.select.options.get(name, {}))
        return self._selectors[name]

    def draft(self, model: str | None, layers: int | None):
        """Draft for draft-guided selectors, loaded once; None means the configured one. "self" here loads the
        target's HF weights a second time (SGLang's fused modules cannot run the transformers draft code), so it
        costs the draft's weight memory."""
        model = model or self.config.draft.model
        layers = self.config.draft.layers if layers is None else layers
        if (model, layers) not in self._drafts:
            from chunkcache.draft import load

            target, device = None, self.token_to_kv_pool.device
            if model == "self":
                from transformers import AutoModelForCausalLM

                target = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.config.draft.dtype)).to(device)
            self._drafts[model, layers] = load(model, layers, self.config.draft.dtype, device, target=target)
        return self._drafts[model, layers]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def fallback(self, req, reason: str, detail: str) -> None:
        """The request is computed in full instead of blended: said in the log, a metric and its meta_info."""
        log.warning("chunkcache: request %s computed in full (%s): %s", getattr(req, "rid", "?"), reason, detail)
        metrics.record_fallback(reason)
        metrics.set_store_stats(self.store.stats())  # e.g. an entry dropped while planning it
        _add_round(req, {"fallback": reason, "detail": detail})

    def record(self, req, info: dict) -> None:
        log.info("chunkcache: request %s %s", getattr(req, "rid", "?"), info)
        metrics.record_request(info)
        metrics.set_store_stats(self.store.stats())
        _add_round(req, info)

    def chunkcache_state(self) -> dict:
        """What /server_info reports under internal_states[i]['chunkcache']."""
        return {"backend": BACKEND_NAME, "tree_cache": type(self).__name__, "scheduler_pid": os.getpid(),
                "store": dataclasses.asdict(self.store.stats()),
                "kv_pool": {"available": int(self.token_to_kv_pool_allocator.available_size()),
                            "evictable": int(self.evictable_size()), "protected": int(self.protected_size())}}


def _add_round(req, info: dict) -> None:
    """`req.chunkcache_info` (what meta_info reports) accounts for every prefill round of the request: the last
    round's report, with all rounds listed when there were several, and a round computed in full stays visible as
    the top-level `fallback` after a later round blends."""
    rounds = req.__dict__.setdefault("chunkcache_rounds", [])
    rounds.append(info)
    merged = dict(info)
    if len(rounds) > 1:
        merged["rounds"] = list(rounds)
        full = next((r for r in rounds if "fallback" in r), None)
        if full is not None and "fallback" not in merged:
            merged["fallback"], merged["detail"] = full["fallback"], full["detail"]
    req.chunkcache_info = merged


def factory(ctx: TreeCacheBuildContext) -> ChunkRadixCache:
    def build(params):
        return ChunkRadixCache(params, model_config=ctx.model_config, model_path=ctx.server_args.model_path)

    return create_unified_radix_cache(ctx, cache_class=build)
