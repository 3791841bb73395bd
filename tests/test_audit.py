"""The online audit's arithmetic (chunkcache/blend/audit.py): the KL over an answer's tokens and the first token's
agreement of two logit rows,
the sample, each audited request's bound, and the margin a window that breaks the promise widens. The server's side
(the full recompute when idle, /metrics, the widened estimates served) is tests/test_audit_serving.py."""

import json
import math
import random
import types

import pytest
import torch

from chunkcache.blend import audit, fidelity
from chunkcache.blend.fidelity import Linear, Model, Signals
from chunkcache.config import Config


def test_first_token_kl_and_agreement_by_hand():
    full = torch.tensor([[0.0, math.log(3.0), -1e9]], dtype=torch.float64)  # p = (1/4, 3/4, 0)
    served = torch.tensor([[0.0, 0.0, -1e9]])  # q = (1/2, 1/2, 0)
    kl, agree = audit.over_answer(full, served)
    assert kl == pytest.approx(0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5), rel=1e-12)
    assert agree is False  # full's argmax is token 1, served's token 0 (the first of a tie)
    kl, agree = audit.over_answer(full, full + 5.0)  # a shift of every logit is the same distribution
    assert kl == pytest.approx(0.0, abs=1e-12) and agree is True


def test_the_kl_over_an_answer_is_its_largest_step_and_agreement_its_first_token():
    same = [0.0, 2.0, 0.0]
    full = torch.tensor([same, [0.0, math.log(3.0), -1e9], same], dtype=torch.float64)
    served = torch.tensor([same, [0.0, 0.0, -1e9], [1.0, 3.0, 1.0]], dtype=torch.float64)
    kl, agree = audit.over_answer(full, served)
    assert kl == pytest.approx(0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5), rel=1e-12)
    assert agree is True  # the first tokens agree; the second step's divergence is the answer's KL


def test_first_token_kl_matches_torch_on_a_vocabulary():
    gen = torch.Generator().manual_seed(0)
    full, served = torch.randn(49152, generator=gen) * 3, torch.randn(49152, generator=gen) * 3
    expected = torch.nn.functional.kl_div(served.double().log_softmax(-1), full.double().log_softmax(-1),
                                          log_target=True, reduction="sum")
    kl, agree = audit.over_answer(full[None], served[None])
    assert kl == pytest.approx(float(expected), rel=1e-9)
    assert agree == (int(full.argmax()) == int(served.argmax()))


@pytest.mark.parametrize("rate", [0.0, 0.25, 1.0])
def test_the_sample_takes_its_rate_and_repeats(rate):
    sampler, again = audit.Sampler(rate), audit.Sampler(rate)
    draws = [sampler.take() for _ in range(4000)]
    assert draws == [again.take() for _ in range(4000)]  # seeded: a run is repeatable
    assert abs(sum(draws) / len(draws) - rate) < 0.03
    if rate in (0.0, 1.0):
        assert set(draws) == {bool(rate)}


def test_an_outcome_is_judged_against_max_kl_else_its_own_estimate():
    floor = audit.Outcome(estimated=0.02, max_kl=0.05, kl=0.04, agree=True)
    assert floor.bound == 0.05 and not floor.unsafe and floor.error == pytest.approx(0.02)
    plain = audit.Outcome(estimated=0.02, max_kl=None, kl=0.04, agree=False)
    assert plain.bound == 0.02 and plain.unsafe
    assert not audit.Outcome(estimated=0.02, max_kl=None, kl=0.02, agree=True).unsafe  # at the bound is within


def outcome(ratio: float, estimated: float = 0.01) -> audit.Outcome:
    """A request without max_kl whose measured KL is `ratio` times its estimate."""
    return audit.Outcome(estimated=estimated, max_kl=None, kl=ratio * estimated, agree=True)


def test_a_full_window_within_the_promise_keeps_the_margin():
    margin = audit.Margin(1.0, window=20, promise=0.1, cap=64)
    for i in range(60):  # 2 of every 20 over: 10 %, not more
        judged = margin.observe(outcome(3.0 if i % 10 == 0 else 0.5))
        assert not judged.broke
    assert margin.factor == 1.0 and judged.share == pytest.approx(0.1)


def test_a_window_past_the_promise_widens_the_margin_as_far_as_it_needed():
    margin = audit.Margin(1.0, window=20, promise=0.1, cap=64)
    ratios = [0.5] * 10 + [5.0, 3.0]
    assert not any(margin.observe(outcome(r)).broke for r in ratios)
    judged = margin.observe(outcome(4.0))  # the third of at most 20 over: the window cannot come back
    assert judged.broke and (judged.over, judged.audited) == (3, 13)
    # all but 2 (10 % of 20) within their bounds once each bound is 3x: the third largest ratio
    assert margin.factor == pytest.approx(3.0)
    assert not margin.window  # the next window judges the new factor
    for r in (5.0, 3.0, 4.0):  # the same requests at 3x the estimate: only the 5x one is over
        assert not margin.observe(outcome(r / 3.0)).broke


def test_a_widening_at_least_doubles_and_stops_at_the_cap():
    margin = audit.Margin(1.0, window=4, promise=0.1, cap=3.0)
    assert margin.observe(outcome(1.1)).broke  # 1 of 4 over is past 10 %
    assert margin.factor == pytest.approx(audit.WIDEN_AT_LEAST)
    assert margin.observe(outcome(100.0)).broke
    assert margin.factor == 3.0  # capped
    assert margin.observe(outcome(100.0)).broke and margin.factor == 3.0


def test_the_margin_brings_a_biased_estimator_back_within_the_promise():
    """An estimator 8x too low: its estimates are 1/8 of each request's 0.9 quantile of KL (lognormal around it). The
    audit widens until the share over their bounds, measured on new requests, is back within the promise."""
    rng = random.Random(1)
    sigma = 1.0
    z90 = 1.2815515655446004

    def request(factor: float) -> audit.Outcome:
        q90 = math.exp(rng.uniform(-6, -2))  # the request's true 0.9 quantile of KL
        kl = q90 * math.exp(sigma * (rng.gauss(0, 1) - z90))
        return audit.Outcome(estimated=q90 * factor / 8, max_kl=None, kl=kl, agree=True)

    margin = audit.Margin(1.0, window=20, promise=0.1, cap=64)
    first = [request(margin.factor) for _ in range(20)]
    assert sum(o.unsafe for o in first) / 20 > 0.5  # the biased estimator breaks its promise
    for _ in range(400):
        margin.observe(request(margin.factor))
    assert 8.0 <= margin.factor <= 64.0  # at least the bias (the 0.9 quantile itself), at most the cap
    fresh = [request(margin.factor) for _ in range(4000)]
    assert sum(o.unsafe for o in fresh) / len(fresh) <= 0.1


def model(margin: float = 0.35) -> Model:
    return Model(quantile=0.9, kl=Linear(-1.0, {"deviation": 1.0}), margin=margin,
                 agree=Linear(0.5, {"deviation": -1.0}), fitted_on="test", covers=1, fingerprint=None, name="m")


def test_the_margin_multiplies_the_estimate_the_report_and_the_floor_read():
    s = Signals(ratio=0.15, mass_left=0.5, attention_left=0.5, deviation=0.2, deviation_left=0.1)
    base, wide = fidelity.estimate(s, model()), fidelity.estimate(s, audit.with_margin(model(), 4.0))
    assert wide.kl == pytest.approx(4.0 * base.kl) and wide.agree == base.agree
    # a quality floor's rho: the bound met by the fitted estimate is missed by the widened one
    assert fidelity.smallest_ratio(lambda rho: s, base.kl, model()) == fidelity.RATIOS[0]
    assert fidelity.smallest_ratio(lambda rho: s, base.kl, audit.with_margin(model(), 4.0)) is None


@pytest.mark.parametrize("body,message", [
    ("audit: {rate: 1.5}", "audit:rate: must be in \\[0, 1\\]"),
    ("audit: {promise: 0}", "audit:promise: must be in \\(0, 1\\)"),
    ("audit: {window: 0}", "audit:window: must be at least 1"),
    ("audit: {margin: 0}", "audit:margin: must be > 0"),
    ("audit: {margin: 8, max_margin: 4}", "audit:max_margin: must be at least margin"),
])
def test_bad_audit_settings_are_refused(tmp_path, body, message):
    path = tmp_path / "c.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        Config.load(path)


def test_the_audit_is_off_by_default():
    assert Config().audit.rate == 0.0


def server(reuse):
    """A ChunkServer's part the audit uses: its reuse and idle queue."""
    from chunkcache.blend.idle import IdleWork
    from chunkcache.ranks import Ranks

    from sglang_patch.forward.forward_pass import Aside

    return types.SimpleNamespace(reuse=reuse, idle=IdleWork(Ranks(), {"audit": 8}), aside=Aside)


class FakeRunner:
    """Runner's part the scheduler's audit uses: a pass over one kept-aside segment, logits out (`full`, or the
    next of `fulls` per pass)."""

    full: torch.Tensor
    fulls: list = []
    passes: list = []

    def __init__(self, model_runner, forward_batch):
        self.model_runner, self.forward_batch, self.device = model_runner, forward_batch, torch.device("cpu")

    def run(self, p, logits=False):
        FakeRunner.passes.append((p, self.forward_batch))
        for segment in p.segments:  # one layer's K/V kept aside, for the next slice to attend to
            segment.kept_kv = [(torch.zeros(len(segment.q_pos), 1, 1),) * 2]
        return types.SimpleNamespace(next_token_logits=(FakeRunner.fulls.pop(0) if FakeRunner.fulls
                                                        else FakeRunner.full)[None])


def test_a_first_token_floor_is_not_audited_against_the_answers_estimator(monkeypatch):
    """The audit's margin widens the answer's estimator: a blend whose floor read the first-token one (kl_over:
    first_token) is not kept, a blend of the same request bounding the answer is."""
    from chunkcache.blend.fidelity import Estimate
    from chunkcache.config import AuditConfig
    from sglang_patch.forward import forward_pass
    from sglang_patch.scheduler import audit as glue

    monkeypatch.setattr(forward_pass, "Runner", FakeRunner)
    config = AuditConfig(rate=1.0)
    a = glue.Audit(server(types.SimpleNamespace(fidelity=model(), config=types.SimpleNamespace(audit=config))), config)
    batch = types.SimpleNamespace(seq_lens=torch.tensor([7]), input_ids=torch.zeros(7, dtype=torch.long))
    for kl_over, kept in (("first_token", 0), ("answer", 1)):
        plan = types.SimpleNamespace(token_ids=torch.arange(7), n=7, max_kl=0.1, selector="mix", kl_over=kl_over)
        b = types.SimpleNamespace(plan=plan, estimate=Estimate(kl=0.1, agree=0.9, fitted_for="m", covers=1), ratio=0.15)
        a.offer(FakeRunner(None, batch), 0, "r", b, types.SimpleNamespace(next_token_logits=torch.zeros(1, 3)))
        assert a.server.idle.waiting("audit") == kept, kl_over


def test_the_scheduler_audit_measures_the_kept_logits_and_widens_what_the_blends_read(monkeypatch, tmp_path,
                                                                                       caplog):
    """sglang_patch.scheduler.audit with the model replaced: the served row's logits are kept, the full recompute
    is one kept-aside segment of the whole prompt attending nothing of the pool, and a broken window replaces the
    estimator the blends read, says so in the log and in /metrics."""
    from prometheus_client import CollectorRegistry

    from chunkcache.blend.fidelity import Estimate
    from chunkcache.config import AuditConfig
    from sglang_patch.forward import forward_pass
    from sglang_patch.scheduler import audit as glue, metrics

    registry = CollectorRegistry()
    metrics.start(True, model_name="m", registry=registry)
    monkeypatch.setattr(forward_pass, "Runner", FakeRunner)
    FakeRunner.passes = []
    config = AuditConfig(rate=1.0, window=2, margin=0.5, cases=str(tmp_path / "cases.jsonl"))
    a = glue.Audit(server(types.SimpleNamespace(fidelity=model(), config=types.SimpleNamespace(audit=config))), config)
    assert a.served.margin == pytest.approx(model().margin + math.log(0.5))
    assert registry.get_sample_value("chunkcache_audit_margin", {"model_name": "m"}) == 0.5
    served = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])  # the batch's rows; the request is row 1
    full = torch.tensor([0.0, 0.0, 2.0])
    FakeRunner.full = full
    plan = types.SimpleNamespace(token_ids=torch.arange(7), n=7, max_kl=None, selector="mix", kl_over="answer")
    b = types.SimpleNamespace(plan=plan, estimate=Estimate(kl=0.1, agree=0.9, fitted_for="m", covers=1), ratio=0.15)
    batch = types.SimpleNamespace(seq_lens=torch.tensor([5, 7]), input_ids=torch.zeros(12, dtype=torch.long))
    a.offer(FakeRunner(None, batch), 1, "r1", b, types.SimpleNamespace(next_token_logits=served))
    with caplog.at_level("WARNING", logger=glue.__name__):
        a.server.idle.run_one()
    (p, fb), = FakeRunner.passes
    (segment,) = p.segments
    assert not segment.to_pool and len(segment.ctx_slots) == 0 and segment.q_pos.tolist() == list(range(7))
    assert torch.equal(torch.cat(p.ids), torch.arange(7)) and fb.seq_lens.tolist() == [7] and not fb.return_logprob
    kl, agree = audit.over_answer(full[None], served[1][None])
    case = json.loads((tmp_path / "cases.jsonl").read_text())
    assert case["kl"] == pytest.approx(kl) and case["agree"] is agree is False and case["unsafe"]
    assert registry.get_sample_value("chunkcache_audit_unsafe_total", {"model_name": "m"}) == 1
    assert registry.get_sample_value("chunkcache_audit_disagreements_total", {"model_name": "m"}) == 1
    # one of at most 2 over is past 10 %: the factor grew to what that request needed
    assert a.margin.factor == pytest.approx(0.5 * kl / 0.1)
    assert a.served.margin == pytest.approx(model().margin + math.log(a.margin.factor))
    assert registry.get_sample_value("chunkcache_audit_margin", {"model_name": "m"}) == pytest.approx(a.margin.factor)
    assert "1 of the last 1 audited requests exceeded" in caplog.text
    assert f"the fidelity margin widens from 0.5 to {a.margin.factor:g}" in caplog.text
    metrics.start(False)


def test_kept_prompts_are_tagged_with_their_tenant_never_the_salt(monkeypatch, tmp_path):
    """audit.keep_prompts writes every tenant's prompts to one file: each line names its tenant, the request's
    namespace (its hint's: the payload's, else the server's store.namespace) and whether it had a cache_salt."""
    from chunkcache.blend.fidelity import Estimate
    from chunkcache.blend.request import ChunkRequest, RequestHint
    from sglang_patch.forward import forward_pass
    from sglang_patch.scheduler import audit as glue, report

    monkeypatch.setattr(forward_pass, "Runner", FakeRunner)
    FakeRunner.passes, FakeRunner.full = [], torch.tensor([0.0, 1.0, 0.0])
    config = Config()
    config.store.namespace = "server-ns"
    config.audit.rate, config.audit.cases, config.audit.keep_prompts = 1.0, str(tmp_path / "cases.jsonl"), True
    a = glue.Audit(server(types.SimpleNamespace(fidelity=model(), config=config)), config.audit)

    def req(namespace: str, salt: str | None, auto: bool = False):
        hint = RequestHint(torch.arange(7), ((1, 4),), ("k",), "mix", 0.15, namespace, auto=auto)
        r = types.SimpleNamespace(cache_salt=salt)
        r.__dict__[report.ATTR] = ChunkRequest("r", hint=hint)
        return r

    # the batch: a client's request in namespace kb1 with a salt, a detected one (the server's namespace), unsalted
    reqs = [req("kb1", "user-7-secret"), req("server-ns", None, auto=True)]
    batch = types.SimpleNamespace(seq_lens=torch.tensor([7, 7]), input_ids=torch.zeros(14, dtype=torch.long),
                                  chunkcache_reqs=reqs)
    layout = types.SimpleNamespace(chunk_spans=[(1, 4)])
    plan = types.SimpleNamespace(token_ids=torch.arange(7), n=7, max_kl=None, selector="mix", kl_over="answer",
                                 layout=lambda: layout)
    b = types.SimpleNamespace(plan=plan, estimate=Estimate(kl=0.1, agree=0.9, fitted_for="m", covers=1), ratio=0.15)
    served = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    for row in (0, 1):
        a.offer(FakeRunner(None, batch), row, f"r{row}", b, types.SimpleNamespace(next_token_logits=served))
        a.server.idle.run_one()
    text = (tmp_path / "cases.jsonl").read_text()
    cases = [json.loads(line) for line in text.splitlines()]
    assert [c["tenant"] for c in cases] == [{"namespace": "kb1", "salted": True},
                                           {"namespace": "server-ns", "salted": False}]
    assert "user-7-secret" not in text
    assert all(c["prompt_ids"] == list(range(7)) and c["chunk_spans"] == [[1, 4]] for c in cases)
    # without keep_prompts no prompt, and no tenant either
    config.audit.keep_prompts = False
    (tmp_path / "cases.jsonl").unlink()
    a.offer(FakeRunner(None, types.SimpleNamespace(seq_lens=torch.tensor([7]), input_ids=torch.zeros(7))), 0, "r",
            b, types.SimpleNamespace(next_token_logits=served))
    a.server.idle.run_one()
    assert not {"tenant", "prompt_ids"} & json.loads((tmp_path / "cases.jsonl").read_text()).keys()


def test_the_audit_measures_the_served_answer_when_the_estimate_covers_it(monkeypatch, tmp_path):
    """An estimate covering 3 answer tokens: the request's first token is served from full's own distribution, its
    second from one that diverges, its third from full's again. The audit keeps what each decode step served, then
    recomputes the prompt in full and teacher-forces the served answer a token at a time; the KL it records is the
    second token's, not the first's (0)."""
    from chunkcache.blend.fidelity import Estimate
    from chunkcache.config import AuditConfig
    from sglang_patch.forward import forward_pass
    from sglang_patch.scheduler import audit as glue

    monkeypatch.setattr(forward_pass, "Runner", FakeRunner)
    config = AuditConfig(rate=1.0, window=100, cases=str(tmp_path / "cases.jsonl"))
    a = glue.Audit(server(types.SimpleNamespace(fidelity=model(), config=types.SimpleNamespace(audit=config))), config)
    fulls = [torch.tensor([0.0, 3.0, 0.0]), torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 3.0])]
    served = [fulls[0], torch.tensor([0.0, 1.0, 0.0]), fulls[2]]
    plan = types.SimpleNamespace(token_ids=torch.arange(5), n=5, max_kl=None, selector="mix", kl_over="answer")
    b = types.SimpleNamespace(plan=plan, estimate=Estimate(kl=0.1, agree=0.9, fitted_for="m", covers=3), ratio=0.15)
    batch = types.SimpleNamespace(seq_lens=torch.tensor([5]), input_ids=torch.zeros(5, dtype=torch.long))
    a.offer(FakeRunner(None, batch), 0, "r1", b, types.SimpleNamespace(next_token_logits=served[0][None]))
    req = types.SimpleNamespace(rid="r1", output_ids=[1], finished=lambda: False)
    other = types.SimpleNamespace(rid="r2", output_ids=[0], finished=lambda: False)

    def step(row_logits, token, mode="decode"):
        req.output_ids.append(token)
        rows = torch.stack([torch.zeros(3), row_logits])  # another request's row first
        a.after_batch(types.SimpleNamespace(reqs=[other, req], forward_mode=types.SimpleNamespace(
            is_decode=lambda: mode == "decode")), types.SimpleNamespace(
                logits_output=types.SimpleNamespace(next_token_logits=rows)))

    assert not a.server.idle.waiting("audit")  # decoding: not yet audited
    step(served[1], 1)
    assert not a.server.idle.waiting("audit")
    step(served[2], 2)  # the third token: all it covers
    assert a.server.idle.waiting("audit") == 1 and not a.pending
    FakeRunner.passes, FakeRunner.fulls = [], list(fulls)
    while a.server.idle.waiting("audit"):
        a.server.idle.run_one()
    # the prompt in one pass, then the answer's first two tokens teacher-forced, one each
    assert [torch.cat(p.ids).tolist() for p, _ in FakeRunner.passes] == [list(range(5)), [1], [1]]
    segments = [s for p, _ in FakeRunner.passes for s in p.segments]
    assert [s.q_pos.tolist() for s in segments] == [list(range(5)), [5], [6]]
    assert [len(s.ctx_slots) for s in segments] == [0, 5, 6]  # each attends to the prompt and the answer so far
    kl, agree = audit.over_answer(fulls[1][None], served[1][None])
    assert kl > 0.5
    case = json.loads((tmp_path / "cases.jsonl").read_text())
    assert case["kl"] == pytest.approx(kl) and case["answer_tokens"] == 3 and case["covers"] == 3
    assert case["agree"] is True and case["unsafe"]  # first tokens agree; the answer is over its estimate
