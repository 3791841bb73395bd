"""Whether blending a request is predicted faster than computing it in full, from rates measured on this host.

Both sides are priced at the same three rates, since the blend runs the model's own layers and, on CPU, attends at
the causal kernel's rate per (query, key) pair (chunkcache.blend.attention's staircase):

    stock  = E x token_s + P_stock x pair_s                      E extend tokens, P_stock their causal pairs
    blend  = (F + M + Q + D) x token_s + (P_fill + P_blend + P_query + P_dev) x pair_s + R x copy_s
             F the unmatched shared prefix (computed exactly first), M tokens recomputed (rho of the reused context,
             the query, every token between chunks), R reused tokens copied, Q the query pass's tokens (selectors
             that read the query's attention), D the deviation pass's (selectors that measure it)

`Work` counts these once per blend; the server's admission charges the same count.

P_blend assumes the picks spread evenly over the reused context (what a pick attends is its position). The rates
(`Rates`) are measured once per host and model shape and kept (chunkcache.cpu_dtype.kept_per_host): the model's
matmuls per token, causal SDPA per pair, and a memory copy of a token's KV. What they leave out, a fixed time per
forward and each side's distance from them, the server learns from its own forwards (`Calibration`): a blend runs
two or three forwards where a full prefill runs one, which decides short prompts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from ..config import digest, home
from ..cpu_dtype import best_seconds, host_signature, kept_per_host
from ..select.base import QUERY_PASS_TOKENS, needs
from .plan import RequestPlan


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"


@dataclass(frozen=True)
class Rates:
    token_s: float  # one token through every layer's matmuls
    pair_s: float  # one (query, key) pair of causal attention, every layer
    copy_s: float  # one reused token's KV (every layer) copied into the pool


# the stages of a blend that run forwards of the model, each one forward (chunkcache.blend.pipeline: the fill computes
# the unmatched prefix and missing chunks, the query and deviation passes are the feature stage's, then the recompute)
FORWARDS = ("fill", "query", "deviation", "recompute")


@dataclass(frozen=True)
class Prediction:
    blend_s: float
    stock_s: float
    tokens: int = 0  # what the blend computes: tokens through every layer (fill, recompute, query pass)
    pairs: int = 0  # and the (query, key) pairs they attend
    reused: int = 0  # tokens whose KV it copies
    margin: float = 0.0  # the blend is chosen when predicted at least this fraction faster (select.blend_margin)
    # the blend's seconds at the rates per stage (FORWARDS and "copy"; Work.priced); empty: priced as a whole
    stages: Mapping[str, float] = field(default_factory=dict)

    @property
    def blend(self) -> bool:
        return self.blend_s < (1.0 - self.margin) * self.stock_s

    @property
    def forwards(self) -> int:
        """Forwards the blend runs (at least its recompute)."""
        return max(1, sum(self.stages.get(stage, 0.0) > 0 for stage in FORWARDS))

    def report(self) -> dict:
        return {"choice": "blend" if self.blend else "full", "predicted_blend_s": round(self.blend_s, 4),
                "predicted_full_s": round(self.stock_s, 4)}


class Calibration:
    """How this server's forwards run against the rates' prices, learned from its own forwards: each forward takes a
    fixed time (the weights read from memory once, most likely, SGLang's Python per layer, the scheduler: what
    rates measured on 512 rows of cached weights leave out; ~60 ms for the default model on a 2-core AMD EPYC,
    where a 136-token prompt's whole priced work is ~70 ms) plus a side's scale of its priced work (a blend's
    forwards run the selector's kernels, a full prefill SGLang's; a short forward's few rows run the matmuls slower
    than 512 do).

    * `fixed_s` is read off the query pass (observed as a "probe"): a forward of a few dozen rows, most of whose time
      is the fixed part: the median of its seconds less its priced work at the blend's scale;
    * a side's scale at a size is the median of (seconds - fixed_s) / priced over the NEAREST of its last WINDOW
      forwards in priced work ("blend": the recompute pass, "full": SGLang's own extend), each priced at
      MIN_PRICED_SHARE of the fixed time or more (a shorter one's time is its fixed part and noise); a side not
      observed yet takes the other's, since scaling one side alone would bias the choice.

    Medians, so that one stalled forward (the first one after start-up builds oneDNN's kernels) moves nothing. A blend
    of F forwards is then predicted at F x fixed_s + scale x its priced compute + its copy, a full prefill at
    fixed_s + scale x its price."""

    # forwards kept per kind (those priced too short for a scale among them)
    WINDOW = 30
    # forwards a kind must have been observed in before it says anything (the blend's recompute: before any)
    MIN_OBSERVED = 3
    # forwards a scale at a size is read from: those nearest to it in priced work
    NEAREST = 7
    KINDS = ("probe", "blend", "full")
    # a blend or full forward informs its side's scale when priced at this share of the fixed time or more; before
    # any probe (a selector without a query pass), at MIN_PRICED_S or more
    MIN_PRICED_SHARE = 0.1
    MIN_PRICED_S = 0.25

    def __init__(self):
        self.seen: dict[str, deque[tuple[float, float]]] = {k: deque(maxlen=self.WINDOW) for k in self.KINDS}
        self.observed = dict.fromkeys(self.KINDS, 0)

    def observe(self, kind: str, priced_s: float, actual_s: float) -> None:
        """One forward of `kind` (KINDS) priced at `priced_s` by the rates took `actual_s`."""
        if priced_s > 0:
            self.seen[kind].append((priced_s, actual_s))
            self.observed[kind] += 1

    def _probed(self, scale: float = 1.0) -> float | None:
        probes = self.seen["probe"]
        if len(probes) < self.MIN_OBSERVED:
            return None
        return max(0.0, statistics.median(a - scale * p for p, a in probes))

    def _scale(self, kind: str, fixed: float | None, near: float | None = None) -> float | None:
        """`kind`'s scale over all its forwards, or at priced work `near`; None before MIN_OBSERVED."""
        least = self.MIN_PRICED_S if fixed is None else self.MIN_PRICED_SHARE * fixed
        points = [(priced, actual) for priced, actual in self.seen[kind] if priced >= least]
        if len(points) < self.MIN_OBSERVED:
            return None
        if near is not None and near > 0:
            points = sorted(points, key=lambda point: abs(math.log(point[0] / near)))[: self.NEAREST]
        scale = statistics.median((actual - (fixed or 0.0)) / priced for priced, actual in points)
        return scale if scale > 0 else None

    def _fixed(self) -> tuple[float | None, float] | None:
        """(the fixed time, None without probes; the blend's scale over all its forwards); None before the blend's
        recompute was observed."""
        fixed = self._probed()
        blend = self._scale("blend", fixed)
        if blend is None:
            return None
        if fixed is not None:  # once more, the probes' priced work at the blend's scale
            fixed = self._probed(blend)
            blend = self._scale("blend", fixed) or blend
        return fixed, blend

    def fit(self) -> tuple[float, dict[str, float]] | None:
        """(fixed seconds per forward, scale per side over all its forwards); None before the blend's recompute was
        observed."""
        fitted = self._fixed()
        if fitted is None:
            return None
        fixed, blend = fitted
        return fixed or 0.0, {"blend": blend, "full": self._scale("full", fixed) or blend}

    def scale(self, side: str) -> float:
        """A side's scale of the rates' prices over all its forwards (1 before any fit)."""
        fitted = self.fit()
        return 1.0 if fitted is None else fitted[1][side]

    def state(self) -> dict:
        """What /server_info reports."""
        fitted = self.fit()
        return {"fixed_s": None if fitted is None else round(fitted[0], 4),
                "scale": None if fitted is None else {k: round(v, 3) for k, v in fitted[1].items()},
                "observed": dict(self.observed)}

    def apply(self, p: "Prediction") -> "Prediction":
        """`p` at this server's fixed time and each side's scale at `p`'s sizes (the blend's at its recompute's)."""
        fitted = self._fixed()
        if fitted is None:
            return p
        fixed, overall = fitted
        blend = self._scale("blend", fixed, p.stages.get("recompute") or p.blend_s) or overall
        full = self._scale("full", fixed, p.stock_s) or blend
        copy, fixed = p.stages.get("copy", 0.0), fixed or 0.0
        return replace(p, blend_s=p.forwards * fixed + blend * (p.blend_s - copy) + copy,
                       stock_s=fixed + full * p.stock_s)


def full_s(extend: int, prefix: int, rates: Rates) -> float:
    """A plain prefill of `extend` tokens after `prefix` cached ones, at the rates."""
    n = prefix + extend
    return extend * rates.token_s + (n * (n + 1) - prefix * (prefix + 1)) / 2 * rates.pair_s


def host_rates(shape: ModelShape) -> Rates:
    """This host's rates for `shape`: kept, or measured now (~1 s) and kept in `home()/host-rates.json`."""
    key = f"{host_signature()}|{shape}"
    return Rates(**kept_per_host(home() / "host-rates.json", key, lambda: asdict(measure(shape))))


def rates_fingerprint(rates: Rates | None) -> str:
    """A short digest of `rates` ("none": the server runs without them), for comparing the tensor-parallel ranks'
    (chunkcache.ranks.Ranks.check_alike): ranks measuring their own (no kept file, or one per node) would price the
    same blend apart."""
    return "none" if rates is None else digest(asdict(rates))


def measure(shape: ModelShape, tokens: int = 512, keys: int = 1024) -> Rates:
    """This host's rates for `shape`, timed on `tokens` rows and a causal attention over `keys`. The operands are
    drawn from a generator of their own: torch's global one is seeded alike on every tensor-parallel rank by SGLang
    and samples their tokens, and only the ranks lacking a kept file measure, so drawing from it would set the ranks'
    sampling apart."""
    dtype = getattr(torch, shape.dtype)
    h, d = shape.hidden, shape.head_dim
    gen = torch.Generator().manual_seed(0)

    def drawn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    x = drawn(tokens, h)
    weights = [drawn(h, (shape.heads + 2 * shape.kv_heads) * d), drawn(shape.heads * d, h),
               drawn(h, 2 * shape.intermediate), drawn(shape.intermediate, h)]
    inputs = [x, drawn(tokens, shape.heads * d), x, drawn(tokens, shape.intermediate)]
    layer = best_seconds(lambda: [a @ w for a, w in zip(inputs, weights)])
    q = drawn(1, shape.heads, keys, d)
    k, v = (drawn(1, shape.kv_heads, keys, d) for _ in range(2))
    attention = best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=shape.heads != shape.kv_heads))
    kv_bytes = 2 * shape.layers * shape.kv_heads * d * dtype.itemsize
    src = torch.ones(max(64 << 20, kv_bytes) // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = best_seconds(lambda: dst.copy_(src)) / src.nbytes
    return Rates(token_s=layer / tokens * shape.layers, pair_s=attention / (keys * (keys + 1) / 2) * shape.layers,
                 copy_s=copy * kv_bytes * 2)  # read from the entry and written to the pool


@dataclass(frozen=True)
class Work:
    """What one blend computes, counted once from its plan: the server's admission charges `tokens` against the
    prefill budget, `predict` prices them."""

    exact_prefix: int  # the unmatched shared prefix, computed exactly first
    missing: int  # chunk tokens no store holds, computed standalone after the shared prefix
    recomputed: int  # the selector's picks, every token between chunks and the query, through every layer
    query_rows: int  # the query pass's rows (a selector reading the query's attention: Layout.query_pass)
    deviation: int  # the KV deviation pass, as whole-model tokens (every token after the prefix, its first layers)
    reused: int  # context tokens whose stored KV is copied in
    # (query, key) pairs each of them attends
    prefix_pairs: float
    missing_pairs: float
    query_pairs: float
    deviation_pairs: float
    recompute_pairs: float
    # the stage whose forward computes the exact prefix (FORWARDS): the fill's when a chunk is missing, else the
    # first pass after it that attends it (the engine's leads); a deviation pass stops early, so a prefix before one
    # is a forward of its own, counted as the fill's
    prefix_stage: str = "fill"

    @property
    def tokens(self) -> int:
        """Tokens through every layer."""
        return self.exact_prefix + self.missing + self.recomputed + self.query_rows + self.deviation

    @property
    def pairs(self) -> float:
        return self.prefix_pairs + self.missing_pairs + self.query_pairs + self.deviation_pairs + self.recompute_pairs

    def priced(self, rates: Rates) -> dict[str, float]:
        """Seconds at `rates` per stage: each of FORWARDS (0 where it does not run) and the copy."""
        t, p = rates.token_s, rates.pair_s
        stages = {"fill": self.missing * t + self.missing_pairs * p,
                  "query": self.query_rows * t + self.query_pairs * p,
                  "deviation": self.deviation * t + self.deviation_pairs * p,
                  "recompute": self.recomputed * t + self.recompute_pairs * p, "copy": self.reused * rates.copy_s}
        stages[self.prefix_stage] += self.exact_prefix * t + self.prefix_pairs * p
        return stages


def work(plan: RequestPlan, selector, n_layers: int, held: Sequence[bool] | None = None) -> Work:
    """`selector`'s blend of `plan` (its `needs` say which passes run; a `fixed_ratio` replaces the plan's rho),
    on a model of `n_layers`; `held`: per plan chunk, whether the store holds it (None: all). The picks are assumed
    spread evenly over the reused context (what a pick attends is its position). A deviation the selector reads from
    the store (a remembered one) costs nothing; one it may measure is counted as measured (which chunks remember one
    is known only once their entries are read)."""
    n, start = plan.n, plan.matched
    spans = [c.span for c in plan.chunks]
    reused = sum(e - s for s, e in spans)
    missing = 0 if held is None else sum(e - s for (s, e), h in zip((c.chunk for c in plan.chunks), held) if not h)
    between = (plan.query - plan.start) - reused  # tokens between chunks: always recomputed
    fixed = getattr(selector, "fixed_ratio", None)
    picks = math.ceil((plan.ratio if fixed is None else fixed) * reused)
    query = n - plan.query
    exact_prefix = plan.start - start
    recompute_pairs = (picks + between) * (plan.start + plan.query) / 2 + query * n
    shared = plan.shared_prefix_len
    prefix_pairs = exact_prefix * (start + plan.start) / 2
    missing_pairs = sum((e - s) * (shared + (e - s + 1) / 2) for (s, e), h in
                        zip((c.chunk for c in plan.chunks), held or [True] * len(spans)) if not h)
    wanted = needs(selector)
    rows = min(query, QUERY_PASS_TOKENS) if any(name == "query_attention" for name, _ in wanted) else 0
    query_pairs = rows * (plan.start + reused + rows)
    deviation, deviation_pairs = 0, 0.0
    measured = [args for name, args in wanted if name in ("kv_deviation", "known_deviation")]
    if measured:
        share = (measured[0][0] + 1) / n_layers  # args[0]: the check layer; the pass stops after it
        deviation = math.ceil((n - plan.start) * share)
        deviation_pairs = (n - plan.start) * (plan.start + (n - plan.start + 1) / 2) * share
    passes = [name for name, _ in wanted if name in ("query_attention", "kv_deviation", "known_deviation")]
    prefix_stage = ("fill" if missing or (passes and passes[0] != "query_attention")
                    else "query" if passes else "recompute")
    return Work(exact_prefix, missing, picks + between + query, rows, deviation, reused, prefix_pairs, missing_pairs,
                query_pairs, deviation_pairs, recompute_pairs, prefix_stage)


def predict(plan: RequestPlan, selector, rates: Rates, n_layers: int, margin: float = 0.0) -> Prediction:
    """A request whose chunks are all stored (one with a missing chunk blends to store it), blended by `selector`
    (Work); `margin`: Prediction.margin."""
    w = work(plan, selector, n_layers)
    stages = w.priced(rates)
    return Prediction(sum(stages.values()), full_s(plan.n - plan.matched, plan.matched, rates), w.tokens,
                      int(w.pairs), w.reused, margin, stages)


class ComputeCost:
    """Seconds this server takes to compute a chunk inside its blend (the fill step: every missing chunk standalone
    after its request's shared prefix), for the store's fetch-or-compute rule (chunkcache.store.remote). Measured:
    the median seconds per token of its last WINDOW fills that computed at least MIN_TOKENS chunk tokens; before
    that, the host's rates when the server has them (a chunk after no prefix, at the blend side's calibration);
    else unknown (None: the store fetches)."""

    WINDOW = 15
    MIN_TOKENS = 32

    def __init__(self, rates: Callable[[], Rates | None], calibration: Calibration):
        self._rates, self._calibration = rates, calibration
        self._per_token: deque[float] = deque(maxlen=self.WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= self.MIN_TOKENS:
            self._per_token.append(seconds / tokens)

    @property
    def per_token_s(self) -> float | None:
        """The measured seconds per chunk token; None before a fill was observed."""
        return statistics.median(self._per_token) if self._per_token else None

    def chunk_s(self, tokens: int) -> float | None:
        measured = self.per_token_s
        if measured is not None:
            return tokens * measured
        rates = self._rates()
        return None if rates is None else full_s(tokens, 0, rates) * self._calibration.scale("blend")
