"""What every blend of one serving model shares, and a request's hint resolved against it.

A server (sglang_patch.scheduler.cache) holds one `ChunkReuse`: the config, the chunk store, the model's KV layout and
RoPE, the selectors and the models selectors load. `hint()` turns a validated chunkcache payload into a `RequestHint`
(chunkcache.blend.request): the server's defaults filled in and every chunk's store key hashed, once per request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..config import Config
from ..hashing import entry_key, prefix_key, tenant_key
from ..hints import parse
from ..ranks import Ranks, all_hold
from ..rope import RopeSpec
from ..segment import break_ids
from ..select import REGISTRY, Selector
from ..store import ChunkStore, EntryLayout
from . import fidelity
from .auto import AutoChunks, Segments, canonical_head
from .cost import Calibration, ComputeCost, Rates
from .features import Models
from .pipeline import Defaults
from .request import RequestHint

log = logging.getLogger(__name__)


class ChunkReuse:
    def __init__(self, config: Config, store: ChunkStore, layout: EntryLayout, rope: RopeSpec, model_path: str,
                 device: torch.device | str, ranks: Ranks = Ranks(), rates: Rates | None = None):
        """`ranks`: the tensor-parallel ranks that run this model's forwards together (their decisions agree);
        `rates`: this host's compute rates when a request is blended only if predicted faster (None: always)."""
        self.config, self.store, self.layout, self.rope = config, store, layout, rope
        self.ranks = ranks
        self.fingerprint = layout.model_fingerprint
        self.model_path, self.device = model_path, device
        self.models = Models(model_path, self._load_draft, (config.draft.model, config.draft.layers))
        self._selectors: dict[str, Selector] = {}
        self.rates = rates
        self.calibration = Calibration()  # this server's forwards against the rates' predictions
        self.compute = ComputeCost(lambda: self.rates, self.calibration)  # a chunk's cost here, against fetching it
        self.auto = AutoChunks(config.auto, self._break_ids(), self.fingerprint,
                               canonical_head(self.models.tokenizer, config.auto.head)) \
            if config.auto.enabled else None
        # this model's fidelity estimator; None: none was fitted
        self.fidelity = fidelity.coefficients(config.select.calibration).model(model_path)
        if self.fidelity is None:
            log.warning("chunkcache: no fidelity estimator was fitted for %s: its blends report no estimate "
                        "(fidelity.fitted_for: null) and requests with max_kl are computed in full (fallback "
                        "'uncalibrated'); fit one with `chunkcache calibrate --model %s` (docs/calibration.md)",
                        model_path, model_path)

    def held(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether every rank's store holds it (a decision that fixes which rows a forward computes may
        count a chunk as stored only then)."""
        return self.ranks.agree(lambda: [k in self.store for k in keys], all_hold)

    @property
    def entry_shape(self) -> tuple[int, int, int]:
        """A stored entry's K per token: (layers, KV heads, head dim)."""
        return self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim

    def selector(self, name: str) -> Selector:
        if name not in self._selectors:
            self._selectors[name] = REGISTRY.create(name, **self.config.select.options.get(name, {}))
        return self._selectors[name]

    def hint(self, payload: dict, token_ids: Sequence[int], cache_salt: str | None = None) -> RequestHint | None:
        """The client's chunks; None for a payload without spans (options only: `defaults` reads them). Raises
        HintError for a malformed payload."""
        ids = list(token_ids)
        parsed = parse(payload, len(ids), self.config.limits.max_spans, selectors=REGISTRY)
        if not parsed.token_spans:
            return None
        select = self.config.select
        namespace = parsed.namespace or self.config.store.namespace
        tenant, prefix = tenant_key(namespace, cache_salt), prefix_key(ids[: parsed.token_spans[0][0]])
        return RequestHint(
            token_ids=torch.tensor(ids, dtype=torch.long), spans=parsed.token_spans,
            keys=tuple(entry_key(self.fingerprint, tenant, prefix, ids[s:e]) for s, e in parsed.token_spans),
            selector=parsed.selector or select.selector, ratio=select.ratio if parsed.ratio is None else parsed.ratio,
            namespace=namespace, max_kl=self._floor(parsed.max_kl, parsed.ratio), kl_over=parsed.kl_over or "answer",
            tenant=tenant, context=prefix)

    def segments(self, token_ids: Sequence[int], namespace: str | None, cache_salt: str | None,
                 readings: bool = True) -> Segments:
        """The prompt's reusable segments for the tenant of `namespace` (None: the server's) and `cache_salt`
        (auto detection must be on); `readings`: see AutoChunks.segments."""
        return self.auto.segments(token_ids, namespace or self.config.store.namespace, cache_salt, readings)

    def defaults(self, payload: dict | None = None) -> Defaults:
        """What a hint found by automatic detection asks for: the server's selector, ratio, namespace and floor,
        where the request's payload (options only, validated) does not set its own."""
        select, parsed = self.config.select, parse(payload or {}, 1, selectors=REGISTRY)
        return Defaults(parsed.selector or select.selector, select.ratio if parsed.ratio is None else parsed.ratio,
                        parsed.namespace or self.config.store.namespace,
                        self._floor(parsed.max_kl, parsed.ratio), parsed.kl_over or "answer")

    def _floor(self, asked: float | None, ratio: float | None) -> float | None:
        """A request's quality floor: its own, else the server's unless the request set its ratio."""
        return asked if asked is not None else (self.config.select.max_kl if ratio is None else None)

    def _break_ids(self) -> frozenset[int]:
        """Token ids whose text holds a line break: every segment ends after one (chunkcache.segment)."""
        tok = self.models.tokenizer
        return break_ids(tok.batch_decode([[i] for i in range(len(tok))]))

    def _load_draft(self, model: str, layers: int | None):
        """"self" loads the target's HF weights a second time (a serving engine's fused modules cannot run the
        transformers draft code), so it costs the draft's weight memory."""
        from ..draft import load

        target = None
        if model == "self":
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.config.draft.dtype))
            target = target.to(self.device)
        return load(model, layers, self.config.draft.dtype, self.device, target=target)
