"""What every blend of one serving model shares, and a request's hint resolved against it.

A server (sglang_patch.scheduler.cache) holds one `ChunkReuse`: the config, the chunk store, the model's KV layout and
RoPE, the selectors and the models selectors load. `hint()` turns a validated chunkcache payload into a `RequestHint`
(chunkcache.blend.request): the server's defaults filled in and every chunk's store key hashed, once per request.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ..config import Config
from ..hashing import chunk_key, prefix_key
from ..hints import parse
from ..ranks import Ranks, all_hold, deepest_held
from ..rope import RopeSpec
from ..segment import break_ids
from ..select import REGISTRY, Selector
from ..store import ChunkStore, EntryLayout
from . import fidelity
from .auto import AutoChunks, HeadForm, Segments
from .cost import Calibration, ComputeCost, Rates
from .features import DeviationJob, Models
from .pipeline import Defaults, store_segments
from .request import RequestHint

log = logging.getLogger(__name__)
# an engine's forward of token ids from position 0, attending nothing else: K and V [layers, tokens, heads, dim]
KVOf = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# deferred deviation measurements kept at most (each holds its request's plan and chunk entries until measured)
DEFERRED_JOBS = 32


class ChunkReuse:
    def __init__(self, config: Config, store: ChunkStore, layout: EntryLayout, rope: RopeSpec, model_path: str,
                 device: torch.device | str, ranks: Ranks = Ranks()):
        """`ranks`: the tensor-parallel ranks that run this model's forwards together (their decisions agree)."""
        self.config, self.store, self.layout, self.rope = config, store, layout, rope
        self.ranks = ranks
        self.fingerprint = layout.model_fingerprint
        self.model_path, self.device = model_path, device
        self.models = Models(model_path, self._load_draft, (config.draft.model, config.draft.layers))
        # tokens one fill forward may compute (the server's chunked-prefill size, once the scheduler has resolved
        # it); None: unbounded
        self.prefill_budget: int | None = None
        self._selectors: dict[str, Selector] = {}
        # deviations estimated on requests' paths, measured when the server is idle (`measure_deferred`); the
        # oldest are dropped past DEFERRED_JOBS (their chunks are estimated again, and queued again, next use)
        self.deferred: deque[DeviationJob] = deque(maxlen=DEFERRED_JOBS)
        # head forms of passages prompts taught the store deep, computed when the server is idle (`learn_head_form`,
        # after the deferred deviations), each with the engine's forward that computes its KV; the oldest dropped past
        # auto.idle_head_forms
        self.head_forms: deque[tuple[HeadForm, KVOf]] = deque(maxlen=max(config.auto.idle_head_forms, 1))
        self.last_forward = 0.0  # time.monotonic() of the server's last extend forward (the glue sets it)
        # work an engine may leave until its forward's outputs are sent (storing a prompt's learned segments: off
        # the request's first token), run before any later forward can reuse the KV it reads; None: the engine's
        # outputs are not sent in that order (an overlapping scheduler), so such work runs at once
        self.after_outputs: list[Callable[[], None]] | None = None
        self.rates: Rates | None = None  # this host's rates when requests are blended only if predicted faster
        self.calibration = Calibration()  # this server's forwards against the rates' predictions
        self.compute = ComputeCost(lambda: self.rates, self.calibration)  # a chunk's cost here, against fetching it
        self.auto = AutoChunks(config.auto, self._break_ids(), self.fingerprint) if config.auto.enabled else None
        # this model's fidelity estimator; None: none was fitted
        self.fidelity = fidelity.coefficients(config.select.calibration).model(model_path)
        if self.fidelity is None:
            log.warning("chunkcache: no fidelity estimator was fitted for %s: its blends report no estimate "
                        "(fidelity.fitted_for: null) and requests with max_kl are computed in full (fallback "
                        "'uncalibrated'); fit one with `chunkcache calibrate --model %s` (docs/calibration.md)",
                        model_path, model_path)

    def measure_deferred(self) -> None:
        """Measure the oldest deferred deviation, if any, and write what its chunks remember through every tier. A
        failure is logged and the job dropped: its chunks are estimated again next use. Under tensor parallelism the
        measurement is a forward of every rank: a failure there cannot be dropped by one rank alone (the others
        would wait in its all-reduce), so it is raised."""
        if not self.deferred:
            return
        job = self.deferred.popleft()
        try:
            gained = job.run()
        except Exception:  # noqa: BLE001 - an optimisation of later selections: never the server's failure
            if self.ranks.many:
                raise
            log.exception("chunkcache: measuring a deferred chunk deviation failed; its chunks stay estimated")
            return
        for key, feats in gained.items():
            try:
                self.store.add_features(key, feats)
            except Exception:  # noqa: BLE001 - as above; a store write involves no other rank
                log.exception("chunkcache: storing chunk %s's measured deviation failed", key)

    def queue_head_forms(self, forms: Sequence[HeadForm], kv_of: KVOf) -> None:
        """Keep `forms` for idle turns (auto.idle_head_forms > 0), each computed by `kv_of` (the engine's forward of
        its tokens from position 0, attending nothing else: K and V [layers, tokens, heads, dim] on the host); a form
        already waiting is not queued twice."""
        if not self.config.auto.idle_head_forms:
            return
        waiting = {f.key for f, _ in self.head_forms}
        self.head_forms.extend((f, kv_of) for f in forms if f.key not in waiting)

    def learn_head_form(self) -> dict[str, float] | None:
        """Compute and store the oldest waiting head form worth it: forms whose passage the store lost (its deep
        copy), whose head form it holds already (it led a prompt meanwhile) or whose copy it learned in a prompt's
        head itself (ingested, sent alone: it needs no lead) are dropped on the way, so they take no idle turn of
        their own. Returns what the store kept (store_segments), None when nothing was computed. A failure is logged
        and the form dropped, as a deferred deviation's; under tensor parallelism raised (a forward of every rank)."""
        while self.head_forms:
            form, kv_of = self.head_forms.popleft()
            keys = [form.deep_key, form.key]
            _, (deep, head) = self.ranks.decide(
                lambda: self.store.lookup(keys),
                lambda here: [here.entries[k].start_pos if k in here.entries else None for k in keys], deepest_held)
            if deep is not None and deep >= self.config.auto.exact_lead_tokens and head is None:
                break
        else:
            return None
        try:
            k, v = kv_of(form.token_ids)
            return store_segments(self.store, [((form.start, len(form.token_ids)), form.key)], form.token_ids,
                                  lambda positions: (k[:, positions], v[:, positions]), self.fingerprint)
        except Exception:  # noqa: BLE001 - an optimisation of later requests: never the server's failure
            if self.ranks.many:
                raise
            log.exception("chunkcache: computing a passage's head form failed; it gets a lead when it leads")
            return None

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

    def hint(self, payload: dict, token_ids: Sequence[int], cache_salt: str | None = None) -> RequestHint:
        """Raises HintError for a malformed payload."""
        ids = list(token_ids)
        parsed = parse(payload, len(ids), self.config.limits.max_spans, selectors=REGISTRY)
        select = self.config.select
        namespace = parsed.namespace or self.config.store.namespace
        prefix = prefix_key(ids[: parsed.token_spans[0][0]])
        return RequestHint(
            token_ids=torch.tensor(ids, dtype=torch.long), spans=parsed.token_spans,
            keys=tuple(chunk_key(self.fingerprint, namespace, prefix, ids[s:e], cache_salt)
                       for s, e in parsed.token_spans),
            selector=parsed.selector or select.selector, ratio=select.ratio if parsed.ratio is None else parsed.ratio,
            namespace=namespace, max_kl=self._floor(parsed.max_kl, parsed.ratio))

    def segments(self, token_ids: Sequence[int], cache_salt: str | None, edges: bool = True) -> Segments:
        """The prompt's reusable segments under the server's namespace (auto detection must be on); `edges`: see
        AutoChunks.segments."""
        return self.auto.segments(token_ids, self.config.store.namespace, cache_salt, edges)

    @property
    def defaults(self) -> Defaults:
        """What a hint found by automatic detection asks for: the server's selector, ratio, namespace and floor."""
        select = self.config.select
        return Defaults(select.selector, select.ratio, self.config.store.namespace, select.max_kl)

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
