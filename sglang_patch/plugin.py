"""SGLang plugin entry point (group `sglang.srt.plugins`), run by SGLang's load_plugins() in every process.

It registers the `chunkcache` radix-cache backend (sglang_patch.scheduler.cache) and the `chunkcache_torch` attention
backend (sglang_patch.decode.decode_attention), and hooks the SGLang functions listed in `hooks()`: that table is every
place chunk reuse enters SGLang, the frontend interpreter's included (sglang_patch.lang, which also installs its entries
itself in a frontend program: no plugin loader runs there), metrics' start-up and SpeCache's decode step. Beside
the table only its check (`whole`: a process that applied fewer hooks than it names builds no backend); the scheduler
side is sglang_patch.scheduler.server's ChunkServer and the modules beside it.
"""

from __future__ import annotations

import multiprocessing

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from . import lang
from .decode import decode_attention, specache
from .http import chat, hint_validation, routes, usage
from .scheduler import admission, extend, metrics, model_load, report, request_hint, server, startup
from .scheduler.cache import factory
from .serve import shutdown
from .serve.launcher import BACKEND_NAME, cpu_engine_for_stock_command, cpu_groups_without_nccl

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
        register_radix_cache_backend(BACKEND_NAME, whole(factory))
    decode_attention.register()
    for target, hook, kind in hooks():
        HookRegistry.register(target, hook, kind)


def whole(build):
    """The radix-cache factory `build`, refusing to serve when this process applied fewer hooks than the table names:
    SGLang's hook loader only logs a target it cannot resolve and starts anyway, and a server without, say, its
    admission or its report would serve silently half-patched."""

    def checked(ctx):
        missing = unapplied()
        if missing:
            from sglang import __version__

            raise RuntimeError(f"chunkcache: SGLang {__version__} did not apply {len(missing)} of chunkcache's hooks "
                               f"({', '.join(missing)}): chunk reuse is not served half-patched; install the SGLang "
                               f"chunkcache pins, or serve without --radix-cache-backend chunkcache")
        return build(ctx)

    return checked


def unapplied() -> list[str]:
    """The table's targets SGLang's HookRegistry has not patched in this process (it keeps those it did in
    `_patched`, SGLang 0.5.23; tests/test_plugin_hooks.py checks that it still does)."""
    return sorted({target for target, _, _ in hooks()} - HookRegistry._patched)


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
        ("sglang.srt.model_executor.model_runner.ModelRunner.load_model", model_load.loaded_model, AFTER),
        # HTTP server (main process only: resolving its module in a spawned child would import the whole server)
        *([("sglang.srt.entrypoints.http_server.launch_server", routes.add_routes, BEFORE)] if main_process else []),
        # OpenAI chat with documents (main process)
        (f"{_CHAT}.handle_request", chat.handle_request, AROUND),
        (f"{_CHAT}._convert_to_internal_request", chat.attach_hint, AFTER),
        (f"{_CHAT}._build_chat_response", chat.add_report, AFTER),
        # the request contract: hints validated where SGLang tokenizes (main process)
        (f"{_TOKENIZER}._create_tokenized_object", hint_validation.check_request, AFTER),
        # scheduler: the chunk server started once (prefill budget, audit, the ranks' agreement), the hint resolved
        # (or, with auto detection, found) once per request, chunk-aware admission, the blended forward, then the
        # prefill's new paragraphs queued for learning (sglang_patch.scheduler.extend)
        (f"{_SCHEDULER}.init_chunked_prefill", startup.start, AFTER),
        (f"{_SCHEDULER}._create_generation_req", request_hint.on_created, AFTER),
        (f"{_SCHEDULER}.get_prefill_adder_class", admission.adder_class, AFTER),
        ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", extend.attach_batch, AFTER),
        ("sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend", extend.blend_extend, AROUND),
        # a batch with chunks never replays the prefill CUDA graph, which would bypass the blend
        ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
         extend.eager_for_blends, AFTER),
        # idle work (sglang_patch.scheduler.server): a server never idle encodes a taught paragraph after a batch's
        # outputs once the oldest has waited; an idle one runs one job per idle turn
        (f"{_SCHEDULER}.process_batch_result", server.after_batch, AFTER),
        (f"{_SCHEDULER}.on_idle", server.on_idle, BEFORE),
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
        # admin: /flush_cache empties the local tiers (store.clear_on_flush); a purge reaches every rank
        (f"{_SCHEDULER}.flush_cache", server.after_flush, AFTER),
        (f"{_SCHEDULER}.handle_dumper_control", server.on_control, AROUND),
        # /server_info shows which backend really serves, and its state
        ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
         ".get_internal_state", server.report_state, AFTER),
        # chunkcache's /metrics follow the scheduler's --enable-metrics
        *metrics.hooks(),
        # SpeCache's decode (decode.specache): its pool once the runner exists, its decode step, /server_info
        *specache.hooks(),
    ]
