"""SGLang plugin entry point (group `sglang.srt.plugins`), run by SGLang's load_plugins() in every process.

It registers the `chunkcache` radix-cache backend (sglang_patch.scheduler.cache) and the `chunkcache_torch` attention
backend (sglang_patch.decode.decode_attention), and hooks the SGLang functions listed in `hooks()`: that table is every
place chunk reuse enters SGLang, the frontend interpreter's included (sglang_patch.lang, which also installs its entries
itself in a frontend program: no plugin loader runs there), metrics' start-up and SpeCache's decode step.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from chunkcache.blend.cost import full_s
from chunkcache.ranks import RanksFailed

from . import lang
from .decode import decode_attention, specache
from .forward import packed_linear
from .http import chat, hint_validation, ingest, usage
from .scheduler import admission, audit, auto_chunks, blend, metrics, report, request_hint
from .scheduler.cache import factory, reuse_of
from .serve import shutdown
from .serve.launcher import BACKEND_NAME, CPU_LINEAR_ENV, cpu_engine_for_stock_command, cpu_groups_without_nccl

log = logging.getLogger(__name__)
AFTER, AROUND, BEFORE = HookType.AFTER, HookType.AROUND, HookType.BEFORE
_TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_COMPLETION = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer"


def register() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    # no named semaphore for SGLang's SIGKILL to leak (sglang_patch.serve.shutdown)
    shutdown.thread_lock_for_progress_bars()
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, factory)
    decode_attention.register()
    for target, hook, kind in hooks():
        HookRegistry.register(target, hook, kind)


def hooks() -> list[tuple[str, object, HookType]]:
    """(target, hook, kind) for every SGLang function chunkcache hooks, in the order a request meets them."""
    main_process = multiprocessing.parent_process() is None
    return [
        # frontend program (sglang.lang): where the chunks land in the program's text, and forks keep them
        *lang.hooks(),
        # server start-up without a GPU: the CPU engine's settings, before SGLang resolves its arguments and spawns
        # the scheduler (main process: a child gets the resolved arguments)
        *([("sglang.srt.server_args.ServerArgs.resolve_once", cpu_engine_for_stock_command, BEFORE)]
          if main_process else []),
        # the CPU engine's process groups over gloo alone (tensor parallelism without a GPU)
        ("sglang.srt.distributed.parallel_state.init_model_parallel_group", cpu_groups_without_nccl, AROUND),
        # the loaded model: online weight updates refused under chunk reuse, linear weights prepacked on a CPU
        ("sglang.srt.model_executor.model_runner.ModelRunner.load_model", _loaded_model, AFTER),
        # HTTP server (main process only: resolving its module in a spawned child would import the whole server)
        *([("sglang.srt.entrypoints.http_server.launch_server", ingest.add_route, BEFORE)] if main_process else []),
        # OpenAI chat with documents (main process)
        (f"{_CHAT}.handle_request", chat.handle_request, AROUND),
        (f"{_CHAT}._convert_to_internal_request", chat.attach_hint, AFTER),
        (f"{_CHAT}._build_chat_response", chat.add_report, AFTER),
        # the request contract: hints validated where SGLang tokenizes (main process)
        (f"{_TOKENIZER}._create_tokenized_object", hint_validation.check_request, AFTER),
        # scheduler: the hint resolved (or, with auto detection, found) once per request, chunk-aware admission, the
        # blended forward, then the prefill's new segments learned (sglang_patch.scheduler.auto_chunks)
        (f"{_SCHEDULER}._create_generation_req", _resolve_hint, AFTER),
        (f"{_SCHEDULER}.init_chunked_prefill", admission.adopt_budget, AFTER),
        (f"{_SCHEDULER}.init_chunked_prefill", audit.start, AFTER),
        (f"{_SCHEDULER}.get_prefill_adder_class", admission.adder_class, AFTER),
        ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", _attach_batch, AFTER),
        ("sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend", _blend_extend, AROUND),
        # a batch with chunks never replays the prefill CUDA graph, which would bypass the blend
        ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
         _eager_for_blends, AFTER),
        # a server never idle encodes a paragraph prompts taught once the oldest has waited, after a batch's outputs
        (f"{_SCHEDULER}.process_batch_result", auto_chunks.encode_when_starved, AFTER),
        # an idle scheduler measures the chunk deviations requests estimated, else encodes a paragraph prompts taught
        # (auto detection), else audits a blended request (one job per idle turn)
        (f"{_SCHEDULER}.on_idle", _measure_deferred, BEFORE),
        # the chunk report: scheduler -> detokenizer -> main process meta_info["chunkcache"]
        (f"{_STREAMER}._GenerationStreamAccumulator.accept", report.attach, BEFORE),
        (f"{_STREAMER}.SchedulerOutputStreamer.is_request_level_customized_info_key", report.request_level, AFTER),
        (f"{_TOKENIZER}.update_request_meta_info", report.to_meta_info, AROUND),
        # ... and on to OpenAI answers' usage, chat and completions, streamed and not (main process; http.usage)
        (f"{_TOKENIZER}.generate_request", usage.keep_report, AROUND),
        (f"{_CHAT}._build_chat_response", usage.in_answer, AFTER),
        (f"{_COMPLETION}._build_completion_response", usage.in_answer, AFTER),
        (f"{_CHAT}._generate_chat_stream", usage.in_stream, AROUND),
        (f"{_COMPLETION}._generate_completion_stream", usage.in_stream, AROUND),
        # /server_info shows which backend really serves
        ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
         ".get_internal_state", _report_state, AFTER),
        # chunkcache's /metrics follow the scheduler's --enable-metrics
        *metrics.hooks(),
        # SpeCache's decode (decode.specache): its pool once the runner exists, its decode step, /server_info
        *specache.hooks(),
    ]


# the chunk store's KV was computed with the loaded weights, and its keys name the model, not its weights: an online
# update would leave every stored chunk serving the old model's KV
STORE_OUTLIVES_UPDATES = ("chunkcache: online weight updates are refused under chunk reuse: the chunk store holds KV "
                          "computed with the loaded weights. Restart the server with the new weights")


def _loaded_model(result, runner, *args, **kwargs) -> None:
    """Every update path of SGLang checks `_derived_weight_cache_error` over the model's modules before it writes."""
    if runner.server_args.radix_cache_backend == BACKEND_NAME:
        runner.model._derived_weight_cache_error = STORE_OUTLIVES_UPDATES
    if os.environ.get(CPU_LINEAR_ENV) == "packed" and runner.device == "cpu":
        packed_linear.pack(runner.model)


def _resolve_hint(req, scheduler, recv_req, *args, **kwargs) -> None:
    request_hint.attach(reuse_of(scheduler.tree_cache), scheduler.tree_cache, req, _input_logprobs(recv_req))


def _input_logprobs(recv_req) -> bool:
    """Whether the request asked for logprobs of its prompt's tokens (the scheduler resolves `logprob_start_len`
    after creating the Req: -1, its default, scores output tokens only)."""
    start = getattr(recv_req, "logprob_start_len", -1)
    return bool(getattr(recv_req, "return_logprob", False)) and 0 <= start < len(recv_req.input_ids)


def _attach_batch(result, cls, batch, *args, **kwargs):
    """The extend forward needs the batch's requests (their hints) and the scheduler's chunk reuse."""
    result.chunkcache_reqs = batch.reqs
    result.chunkcache_reuse = reuse_of(batch.tree_cache)
    return result


def _eager_for_blends(result, graph_runner, forward_batch, *args, **kwargs) -> bool:
    reqs = getattr(forward_batch, "chunkcache_reqs", None) or ()
    return result and not any(request_hint.of(r) is not None for r in reqs)


def _blend_extend(original, runner, forward_batch, pp_proxy_tensors=None):
    reuse, reqs = getattr(forward_batch, "chunkcache_reuse", None), getattr(forward_batch, "chunkcache_reqs", None)
    out = _extend(original, runner, forward_batch, pp_proxy_tensors, reuse, reqs)
    if reuse is not None:
        reuse.last_forward = time.monotonic()
        _report_exact(forward_batch, reqs or ())
    if reuse is not None and reqs and reuse.auto is not None and reuse.config.auto.learn:
        try:
            auto_chunks.learn(reuse, runner.model_runner, forward_batch, reqs, request_hint.record)
        except Exception:  # noqa: BLE001 - learning is an optimisation: the request's own output is already computed
            log.exception("chunkcache: learning the batch's segments failed; they are not stored")
    return out


def _extend(original, runner, forward_batch, pp_proxy_tensors, reuse, reqs):
    if reuse is None or not reqs or pp_proxy_tensors is not None:
        return original(runner, forward_batch, pp_proxy_tensors)
    if all(request_hint.of(r) is None for r in reqs):
        return _stock_forward(original, runner, forward_batch, pp_proxy_tensors, reuse)
    try:
        out = blend.run(reuse, runner.model_runner, forward_batch, reqs)
    except Exception as exc:  # noqa: BLE001 - a selector or store failure must not take the scheduler down
        # Safe: the stock forward below rewrites the KV of every extend token, and what the blend stored is valid.
        # Under tensor parallelism only a failure every rank agreed on (RanksFailed, raised on all of them at the
        # same point) is: a rank that fell back alone would leave the others waiting in the blend's all-reduces.
        if reuse.ranks.many and not isinstance(exc, RanksFailed):
            log.critical("chunkcache: the blended prefill failed on tensor-parallel rank %d alone; the ranks cannot "
                         "fall back together from here, so the scheduler stops", reuse.ranks.rank)
            raise
        log.exception("chunkcache: blended prefill failed; computing the batch in full")
        for r in reqs:
            if request_hint.of(r) is not None:
                report.fallback(request_hint.record(r), "error", f"{type(exc).__name__}: {exc}")
        out = None
    return _stock_forward(original, runner, forward_batch, pp_proxy_tensors, reuse) if out is None else out


def _report_exact(forward_batch, reqs) -> None:
    """The prompt rounds of requests that asked for exact KV, which SGLang's own forward just computed (a decode
    row of a mixed batch, or a retracted request's re-prefill, is not a prompt round)."""
    for i, req in enumerate(reqs):
        if request_hint.exact(req) is not None and not req.output_ids:
            report.exact(request_hint.record(req), radix=int(forward_batch.extend_prefix_lens_cpu[i]),
                         computed=int(forward_batch.extend_seq_lens_cpu[i]))


def _stock_forward(original, runner, forward_batch, pp_proxy_tensors, reuse):
    """SGLang's own extend forward, timed against the rates' prediction of a full prefill of its rows (the
    calibration of the blend-or-full choice, chunkcache.blend.cost) when the server makes that choice."""
    if reuse.rates is None:
        return original(runner, forward_batch, pp_proxy_tensors)
    t0 = time.perf_counter()
    out = original(runner, forward_batch, pp_proxy_tensors)
    predicted = sum(full_s(e, p, reuse.rates) for e, p in zip(forward_batch.extend_seq_lens_cpu,
                                                                forward_batch.extend_prefix_lens_cpu))
    reuse.calibration.observe("full", predicted, time.perf_counter() - t0)
    return out


# an idle scheduler starts a deferred measurement only this long after its last forward: a job cannot be preempted,
# so one started between the requests of a client that sends them back to back would hold the next one up
DEFER_AFTER_IDLE_S = 0.5


def _measure_deferred(scheduler, *args, **kwargs) -> None:
    """The queue and the scheduler's idleness are the same on every tensor-parallel rank (replicas of one state
    machine, chunkcache.ranks); the idle time is rank 0's, so that every rank enters the measurement's forward. The
    audit waits only where it runs, on one rank (sglang_patch.scheduler.audit refuses it under tensor parallelism)."""
    reuse = reuse_of(scheduler.tree_cache)
    if (reuse is not None and (reuse.deferred or reuse.encodes or audit.pending(reuse))
            and scheduler.is_fully_idle()
            and reuse.ranks.agree(lambda: time.monotonic() - reuse.last_forward >= DEFER_AFTER_IDLE_S)):
        if reuse.deferred:
            reuse.measure_deferred()
        elif reuse.encodes:
            if learned := reuse.encode_next():
                metrics.record_auto_learned(learned["segments"], learned["bytes"], learned["seconds"])
        else:
            audit.of(reuse).run_one()


def _report_state(result, controller, *args, **kwargs):
    tree_cache = controller.scheduler.tree_cache
    state = getattr(tree_cache, "chunkcache_state", None)
    result.internal_state["chunkcache"] = state() if state else {"backend": None, "tree_cache": type(tree_cache).__name__}
    return result
