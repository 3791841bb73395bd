"""SGLang plugin entry point (group `sglang.srt.plugins`), run by SGLang's load_plugins() in every process."""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def register() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from . import cache

    if cache.BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(cache.BACKEND_NAME, cache.factory)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        _report_state,
        HookType.AFTER,
    )


def _report_state(result, controller, *args, **kwargs):
    """Expose the scheduler's tree cache in /server_info, so clients can see which backend really serves them."""
    tree_cache = controller.scheduler.tree_cache
    state = getattr(tree_cache, "chunkcache_state", None)
    result.internal_state["chunkcache"] = state() if state else {"backend": None, "tree_cache": type(tree_cache).__name__}
    return result
