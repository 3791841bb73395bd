"""SGLang plugin entry point (group `sglang.srt.plugins`), run by SGLang's load_plugins() in every process."""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from chunkcache.hints import find_payload

from .request_hint import radix_partition

log = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from . import admission, cache, decode_attention

    if cache.BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(cache.BACKEND_NAME, cache.factory)
    decode_attention.register()
    hooks = {
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state":
            (_report_state, HookType.AFTER),
        "sglang.srt.managers.schedule_batch.Req.__init__": (_namespace_blended, HookType.AFTER),
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": (_attach_reqs, HookType.AFTER),
        "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend": (_blend_extend, HookType.AROUND),
        "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class": (admission.adder_class, HookType.AFTER),
        "sglang.srt.managers.scheduler.Scheduler.init_chunked_prefill": (admission.adopt_budget, HookType.AFTER),
    }
    for target, (fn, kind) in hooks.items():
        HookRegistry.register(target, fn, kind)
    # request contract, meta_info["chunkcache"], /metrics, documents on /v1/chat/completions, /chunkcache/ingest
    from . import chat, hints_http, ingest, meta_info, metrics

    for module in (hints_http, meta_info, metrics, chat, ingest):
        module.register()


def _report_state(result, controller, *args, **kwargs):
    """Expose the scheduler's tree cache in /server_info, so clients can see which backend really serves them."""
    tree_cache = controller.scheduler.tree_cache
    state = getattr(tree_cache, "chunkcache_state", None)
    result.internal_state["chunkcache"] = state() if state else {"backend": None, "tree_cache": type(tree_cache).__name__}
    return result


def _namespace_blended(result, req, *args, **kwargs):
    """A request with chunks gets KV that is approximate past its first chunk: give it its own radix namespace, so
    that no request without chunks can ever match it as an exact prefix (request_hint.radix_partition)."""
    payload = find_payload(getattr(req, "kv_hints", None))
    if payload is not None:
        req.extra_key = radix_partition(payload.get("namespace"), req.extra_key)


def _attach_reqs(result, cls, batch, *args, **kwargs):
    result.chunkcache_reqs = batch.reqs
    return result


def _blend_extend(original, runner, forward_batch, pp_proxy_tensors=None):
    from . import blend, cache

    reqs = getattr(forward_batch, "chunkcache_reqs", None)
    if (cache.ACTIVE is None or not reqs or pp_proxy_tensors is not None
            or not any(find_payload(getattr(r, "kv_hints", None)) is not None for r in reqs)):
        return original(runner, forward_batch, pp_proxy_tensors)
    if forward_batch.return_logprob:
        for r in reqs:
            cache.ACTIVE.fallback(r, "logprobs", "input logprobs need every prompt token's logits")
        return original(runner, forward_batch, pp_proxy_tensors)
    try:
        out = blend.run(cache.ACTIVE, runner.model_runner, forward_batch, reqs)
    except Exception as exc:  # noqa: BLE001 - a selector or store failure must not take the scheduler down
        # Safe: the stock forward below rewrites the KV of every extend token, and what the blend stored is valid.
        log.exception("chunkcache: blended prefill failed; computing the batch in full")
        for r in reqs:
            if find_payload(getattr(r, "kv_hints", None)) is not None:
                cache.ACTIVE.fallback(r, "error", f"{type(exc).__name__}: {exc}")
        out = None
    return original(runner, forward_batch, pp_proxy_tensors) if out is None else out
