"""Per-request chunk-reuse report: `req.chunkcache_info` (scheduler) -> response `meta_info["chunkcache"]`.

The blend sets `req.chunkcache_info` (a dict) on the scheduler's Req. SGLang already carries per-request extras to
the TokenizerManager: `Req.customized_info` -> BatchTokenIDOutput -> detokenizer -> BatchStrOutput ->
`TokenizerManager.update_request_meta_info`. We ride on it with three hooks:
  * scheduler, before `_GenerationStreamAccumulator.accept`: copy `req.chunkcache_info` into `req.customized_info`;
  * scheduler, after `SchedulerOutputStreamer.is_request_level_customized_info_key`: our key is request-level, so
    it is sent once (when a non-streamed request finishes, or with a streamed request's first chunk) rather than
    sliced per output token;
  * main process, around `TokenizerManager.update_request_meta_info`: put the dict itself in meta_info and keep it
    out of SGLang's per-token accumulation (which would turn it into a growing list).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

KEY = "chunkcache"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer"


def register() -> None:
    HookRegistry.register(f"{_STREAMER}._GenerationStreamAccumulator.accept", attach, HookType.BEFORE)
    HookRegistry.register(f"{_STREAMER}.SchedulerOutputStreamer.is_request_level_customized_info_key",
                          request_level, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
                          to_meta_info, HookType.AROUND)


def attach(*args, req, **kwargs) -> None:
    info = getattr(req, "chunkcache_info", None)
    if info is not None:
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[KEY] = [info]


def request_level(result: bool, streamer, key: str) -> bool | None:
    return True if key == KEY else None  # None: SGLang's own answer stands


def to_meta_info(original, manager, meta_info: dict, state, customized_info: dict, index: int, *args, **kwargs):
    if KEY in customized_info:
        values = customized_info[KEY][index]  # [] for requests of the batch without a report
        if values:
            meta_info[KEY] = values[-1]
        customized_info = {k: v for k, v in customized_info.items() if k != KEY}
    return original(manager, meta_info, state, customized_info, index, *args, **kwargs)
