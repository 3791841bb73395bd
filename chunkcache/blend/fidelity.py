"""A blended request's fidelity estimate: the first-token KL divergence of its answer against full recompute (an upper
quantile of it) and the probability that its greedy first token is full recompute's, predicted before the recompute.

Everything the estimate reads is what the selector already read (`Evidence`: its scores, and for `mix` the query's
attention and the chunks' KV deviation, memoised in the request's features), so the signals exist for every candidate
rho without another model pass: `smallest_ratio` tries rho in ascending order, each a selector call over the memoised
features, and the server recomputes once, at the rho it chose. The estimator's form and coefficients are in
configs/fidelity.json (fitted by chunkbench/quality/fidelity_fit.py; the file's `doc` says on what) and, for a
user's own model, the calibrations file `chunkcache calibrate` writes (`coefficients`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import cache
from pathlib import Path

import torch

from ..config import digest, home
from ..hashing import model_fingerprint
from ..select.base import Layout, Selector
from .plan import recompute_set

# the features a deviation-reading selector (mix, cacheblend) may have read, in the order they are preferred
DEVIATIONS = ("remembered_deviation", "known_deviation", "kv_deviation")
# the grid a quality floor's rho is chosen from, and `chunkcache calibrate` measures: past 0.4 a bound the estimate
# cannot meet lower costs 0.6 or 0.8 of the context instead of all of it (docs/bench/fidelity.md)
RATIOS = (0.05, 0.1, 0.15, 0.25, 0.4, 0.6, 0.8)
# the grid of an estimator whose entry names none (a calibrations file written before the grid reached 0.8)
EARLIER_RATIOS = (0.05, 0.1, 0.15, 0.25, 0.4)
# a signal's log is taken at this floor at least: a share left of 0 (everything recomputed) stays finite
FLOOR = 1e-6


@dataclass(frozen=True)
class Evidence:
    """What one request's selector read before its recompute."""

    layout: Layout
    scores: torch.Tensor  # [N] the selector's per-token scores (Selection.scores; mix: a distribution on the context)
    attention: torch.Tensor | None  # [N] Features.query_attention: per layer a distribution over slots, summed
    deviation: torch.Tensor | None  # [N] the KV deviation at the selector's check layer (absolute, L2 over heads)


def evidence(layout: Layout, scores: torch.Tensor, values: Mapping[tuple[str, tuple], torch.Tensor]) -> Evidence:
    """The evidence in a request's memoised features (`values`: RequestFeatures.values, (method, args) -> value)."""
    attention = values.get(("query_attention", ()))
    deviation = next((v for name in DEVIATIONS for (n, _), v in values.items() if n == name), None)
    cpu = (lambda t: None if t is None else t.detach().float().cpu())
    return Evidence(layout, scores.detach().float().cpu(), cpu(attention), cpu(deviation))


@dataclass(frozen=True)
class Signals:
    """One blend's signals: the evidence at one recompute set."""

    ratio: float  # share of the context tokens recomputed
    mass_left: float  # share of the selector's score mass on context tokens not recomputed
    # share of the query's attention (all layers) on context tokens not recomputed; None: the selector read none
    attention_left: float | None
    # the query's attention on each context token times that token's KV deviation, summed over the context tokens,
    # over the query's whole attention: the deviation the answer would read from reused KV with nothing recomputed (the
    # request's level, the same at every rho); None: the selector read no attention or no deviation
    deviation: float | None
    # the same sum over the context tokens not recomputed: the deviation the answer reads from stale KV
    deviation_left: float | None


def signals(ev: Evidence, recomputed: torch.Tensor) -> Signals:
    """`recomputed`: the sorted prompt indices the blend recomputes (Blended.recomputed, plan.recompute_set)."""
    ctx = ev.layout.context_mask()
    left = ctx.clone()
    left[recomputed.long().cpu()] = False
    n_ctx, n_left = int(ctx.sum()), int(left.sum())
    scores = ev.scores.double().clamp_min(0)
    mass = float(scores[ctx].sum())
    attention = ev.attention.double() if ev.attention is not None else None
    total = float(attention.sum()) if attention is not None else 0.0
    read = (attention * ev.deviation.double().clamp_min(0) / total
            if total > 0 and ev.deviation is not None else None)  # [N] the deviation the query reads, per token
    return Signals(
        ratio=(n_ctx - n_left) / n_ctx if n_ctx else 1.0,
        mass_left=float(scores[left].sum()) / mass if mass > 0 else n_left / max(n_ctx, 1),
        attention_left=float(attention[left].sum()) / total if total > 0 else None,
        deviation=float(read[ctx].sum()) if read is not None else None,
        deviation_left=float(read[left].sum()) if read is not None else None)


def at_ratios(selector: Selector, layout: Layout, features) -> Callable[[float], Signals]:
    """Signals at any rho for a request whose features the selector has read already (`features`: the request's
    RequestFeatures, whose memo every call reads: no model pass): the selector's picks at rho, then `signals`."""
    def at(ratio: float) -> Signals:
        selection = selector.select(layout, ratio, features)
        return signals(evidence(layout, selection.scores, features.values), recompute_set(layout, selection.indices))

    return at


@dataclass(frozen=True)
class Linear:
    """intercept + sum of weight * log(max(signal, FLOOR)) over the named Signals fields."""

    intercept: float
    weights: dict[str, float]

    def __call__(self, s: Signals) -> float | None:
        """None when a named signal is None (the blend's selector did not read it)."""
        if any(getattr(s, name) is None for name in self.weights):
            return None
        return self.intercept + sum(w * math.log(max(float(getattr(s, name)), FLOOR))
                                    for name, w in self.weights.items())


@dataclass(frozen=True)
class Model:
    """One model's estimator (configs/fidelity.json's `doc` has a line for each field and what it was fitted on)."""

    quantile: float  # the share of blends whose KL the kl estimate is meant to be at least
    kl: Linear  # log of the KL estimate, `margin` excluded
    margin: float  # added to the log KL: calibrated so choosing rho by the estimate keeps exceedance at `quantile`
    agree: Linear  # logit of the probability that the greedy first token is full recompute's
    fitted_on: str  # cases, selector and model the coefficients come from
    # the answer tokens the kl estimate bounds: the largest KL over the first `covers` tokens of full recompute's
    # answer, each scored on full's answer so far (teacher-forced); 1: the first token only
    covers: int
    fingerprint: str | None  # the weights it was fitted on (hashing.model_fingerprint); None: matched by name
    # the rho it was fitted on: the only ones it chooses from (an estimate is not extrapolated to a rho it never saw)
    ratios: tuple[float, ...] = RATIOS
    # the estimator over the first token only (covers 1), fitted on the same cases: what a request's floor reads when
    # it asks for a first-token bound (kl_over: first_token); None: none fitted, such a request is computed in full
    first_token: "Model | None" = None
    name: str = ""  # its key in the file: the model's name, with `@` and the fingerprint's head for a calibration


@dataclass(frozen=True)
class Coefficients:
    """The coefficients file: an estimator per model it was fitted on, and the default model's name."""

    models: Mapping[str, Model]
    default: str

    def model(self, served: str | os.PathLike | None = None) -> Model | None:
        """The estimator of `served` (a model directory, or a known model's name; None: the default's): the one
        fitted on its weights (same fingerprint: `chunkcache calibrate`), else the one keyed by its name that names no
        fingerprint (the shipped ones; a directory is named after its model); None when none was fitted for it:
        another model's coefficients are not calibrated for it (on Gemma-3-270M's cases SmolLM2's estimate was
        exceeded in 10-16 % of requests: docs/bench/gemma.md)."""
        if served is None:
            return self.models.get(self.default)
        path = Path(served)
        if (path / "config.json").is_file():
            weights = model_fingerprint(path)
            mine = next((m for m in self.models.values() if m.fingerprint == weights), None)
            if mine is not None:
                return mine
        named = self.models.get(path.name)
        return named if named is not None and named.fingerprint is None else None


@dataclass(frozen=True)
class Estimate:
    kl: float  # upper quantile (Model.quantile) of the KL against full recompute over `covers` answer tokens, nats
    agree: float  # probability that the greedy first token is full recompute's
    fitted_for: str  # the model whose cases the estimator was fitted on (Model.name)
    covers: int  # the answer tokens the kl bounds (Model.covers)


def estimator_fingerprint(model: Model | None) -> str:
    """A short digest of the estimator's coefficients and what it was fitted on ("none": the server has none for its
    model), for comparing the tensor-parallel ranks' (chunkcache.ranks.Ranks.check_alike): ranks reading another
    calibrations file would choose another rho for the same request."""
    return "none" if model is None else digest(asdict(model))


def bounding(model: Model | None, kl_over: str) -> Model | None:
    """The estimator a quality floor over `kl_over` (hints.KL_OVER) reads: `model` for the answer, its first-token one
    for the first token (None where that was not fitted: the request is computed in full, as without any)."""
    return model.first_token if model is not None and kl_over == "first_token" else model


def estimate(s: Signals, model: Model) -> Estimate | None:
    """None when the blend lacks a signal the model reads (a selector other than mix: no attention or deviation)."""
    kl, agree = model.kl(s), model.agree(s)
    if kl is None or agree is None:
        return None
    return Estimate(kl=math.exp(kl + model.margin), agree=1.0 / (1.0 + math.exp(-agree)), fitted_for=model.name,
                    covers=model.covers)


def smallest_ratio(signals_at: Callable[[float], Signals], max_kl: float, model: Model,
                   ratios: Sequence[float] | None = None, cap: float = 1.0) -> float | None:
    """The smallest rho of `ratios` (None: the model's grid, Model.ratios), at most `cap`, whose estimated KL is at
    most `max_kl`; None when none is, or the
    blend has no estimate (the request is then computed in full). `signals_at(rho)`: the blend's signals at rho
    (at_ratios). A looser bound never picks a larger rho: every rho that meets a bound meets a looser one."""
    if max_kl < 0:
        raise ValueError(f"max_kl must be >= 0, got {max_kl}")
    for ratio in sorted(r for r in (model.ratios if ratios is None else ratios) if r <= cap):
        est = estimate(signals_at(ratio), model)
        if est is not None and est.kl <= max_kl:
            return ratio
    return None


PACKAGED = Path(__file__).parents[1] / "configs" / "fidelity.json"  # package data, beside the server configs
FILE_FIELDS = ("default", "models")  # the file's own fields, beside `doc`; each model's are Model's but `name`
MODEL_FIELDS = tuple(f.name for f in fields(Model) if f.name != "name")
# model fields an entry may leave out: a file written by an earlier version lacks them (parse_model's defaults)
OPTIONAL_FIELDS = {"ratios", "first_token"}


def calibrations(path: str | os.PathLike | None = None) -> Path:
    """The file `chunkcache calibrate` writes its estimators to (select.calibration; None: under chunkcache's home)."""
    return Path(path).expanduser() if path else home() / "fidelity.json"


@cache
def load(path: str | Path = PACKAGED) -> Coefficients:
    """The coefficients file, read once per path."""
    return parse(json.loads(Path(path).read_text()))


def coefficients(calibrated: str | os.PathLike | None = None) -> Coefficients:
    """The shipped estimators, and before them the calibrations file's (`calibrations(calibrated)`) when there is one:
    what a server and the reference engine estimate with."""
    shipped, path = load(), calibrations(calibrated)
    if not path.is_file():
        return shipped
    try:
        mine = load(path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return Coefficients({**shipped.models, **mine.models}, shipped.default)


def parse(data: Mapping) -> Coefficients:
    """Coefficients from the file's mapping (`default`, `models`: name -> Model's fields, and `doc`: a line for each
    field); ValueError naming what is missing or unknown."""
    documented = set(data.get("doc", {}))
    if set(data) - {"doc"} != set(FILE_FIELDS) or documented - OPTIONAL_FIELDS != \
            set(FILE_FIELDS) | set(MODEL_FIELDS) - OPTIONAL_FIELDS:
        raise ValueError(f"fidelity coefficients: expected fields {sorted(FILE_FIELDS)} and, per model, "
                         f"{sorted(MODEL_FIELDS)}, each with a doc line; got {sorted(set(data) - {'doc'})}, "
                         f"documented {sorted(documented)}")
    models = {name: parse_model(name, part) for name, part in data["models"].items()}
    if data["default"] not in models:
        raise ValueError(f"fidelity coefficients: default {data['default']!r} is not one of the models "
                         f"{sorted(models)}")
    return Coefficients(models, data["default"])


def parse_model(name: str, data: Mapping) -> Model:
    """One model's entry of the file (Model's fields but `name`; without `ratios`, EARLIER_RATIOS); ValueError naming
    what is wrong."""
    if set(data) - OPTIONAL_FIELDS != set(MODEL_FIELDS) - OPTIONAL_FIELDS:
        raise ValueError(f"fidelity coefficients of {name}: expected fields {sorted(MODEL_FIELDS)}, got "
                         f"{sorted(data)}")
    known = {f.name for f in fields(Signals)}
    linear = {}
    for key in ("kl", "agree"):
        part = data[key]
        unknown = set(part.get("weights", {})) - known
        if unknown or "intercept" not in part:
            raise ValueError(f"fidelity coefficients of {name}: {key} needs an intercept and weights on Signals "
                             f"fields; unknown {sorted(unknown)}")
        linear[key] = Linear(float(part["intercept"]), {k: float(v) for k, v in part["weights"].items()})
    if not isinstance(data["covers"], int) or data["covers"] < 1:
        raise ValueError(f"fidelity coefficients of {name}: covers must be an integer >= 1, got {data['covers']!r}")
    ratios = data.get("ratios", list(EARLIER_RATIOS))
    if not isinstance(ratios, list) or not ratios or any(isinstance(r, bool) or not isinstance(r, (int, float))
                                                         or not 0 < r < 1 for r in ratios):
        raise ValueError(f"fidelity coefficients of {name}: ratios must be a non-empty list of rho in (0, 1), "
                         f"got {ratios!r}")
    first = data.get("first_token")
    if first is not None:
        if not isinstance(first, Mapping) or "first_token" in first or first.get("covers") != 1:
            raise ValueError(f"fidelity coefficients of {name}: first_token must be an estimator of its own fields "
                             f"with covers 1 (and no first_token), got {first!r}")
        first = parse_model(name, first)
    return Model(quantile=float(data["quantile"]), kl=linear["kl"], margin=float(data["margin"]),
                 agree=linear["agree"], fitted_on=str(data["fitted_on"]), covers=data["covers"],
                 ratios=tuple(sorted(float(r) for r in ratios)), first_token=first,
                 fingerprint=data["fingerprint"], name=name)
