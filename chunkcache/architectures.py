"""Which models chunk reuse blends: the support table, and the one check every entry point runs on a model's config.

Contract: `check(config, path)` returns the model's RoPE (chunkcache.rope.RopeSpec, per layer where layers differ) when
its architecture is a family of FAMILIES supported on that path ("sglang": the server; "reference": the reference
blender on transformers) and its config uses only what the blend reproduces; otherwise it raises UnsupportedModel
naming the family and the feature. Nothing else decides whether a model may be blended: the
server refuses it at start-up (`chunkcache serve` before launching SGLang, the scheduler's tree cache when started
by SGLang's own command), the reference blender before loading weights. An architecture not in the table is refused:
a model the blend does not understand is never served approximately wrong.

What "supported" means: on the SGLang path a tiny random-weight model of the family blends with `selector: full` to
stock SGLang's greedy tokens on this CPU, and, where the reference path also runs it, with `selector: none` to the
reference blender's tokens (tests/test_architectures.py); on the reference path its full prefill and blends match
transformers' own forward (tests/test_reference.py); its re-rotated keys equal the keys computed at the new position,
per layer type (tests/test_rope.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rope import RopeSpec, UnsupportedRope


class UnsupportedModel(ValueError):
    """The model's attention is not what the blend computes; serving it with chunk reuse would be wrong."""


PATHS = ("sglang", "reference")


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # transformers' `architectures` names
    paths: tuple[str, ...]  # where chunk reuse blends it (of PATHS); empty: refused everywhere
    note: str  # what was verified, or why it is refused


FAMILIES = (
    Family("Llama (Llama 2/3, 3.1 `llama3` RoPE scaling, SmolLM2)", ("LlamaForCausalLM",), PATHS,
           "the default model"),
    Family("Qwen2 / Qwen2.5", ("Qwen2ForCausalLM",), PATHS,
           "the reference path refuses `use_sliding_window: true` (SGLang's Qwen2 attends without the window, and "
           "the blend does as SGLang's layers do)"),
    Family("Qwen3 (dense)", ("Qwen3ForCausalLM",), PATHS,
           "q/k norm runs before RoPE, so stored keys are post-RoPE as for Llama"),
    Family("Mistral", ("MistralForCausalLM",), PATHS,
           "the reference path refuses a `sliding_window` shorter than the context (Mistral 7B v0.1); SGLang's "
           "Mistral attends without it, and the blend does as SGLang's layers do"),
    Family("Phi-3", ("Phi3ForCausalLM",), ("sglang",),
           "SGLang only (the reference path has no fused qkv); the 128k checkpoints are refused (`longrope`)"),
    Family("SmolLM3", ("SmolLM3ForCausalLM",), ("reference",),
           "reference path only: its NoPE layers are re-rotated correctly (per-layer RoPE); SGLang has no SmolLM3 "
           "model of its own to blend in"),
    Family("Gemma 2", ("Gemma2ForCausalLM",), (),
           "attention logit soft-capping on every layer (`attn_logit_softcapping`): the blend's attention does not "
           "cap"),
    Family("Gemma 3 (text)", ("Gemma3ForCausalLM",), ("sglang", "reference"),
           "local layers' sliding window in the blend's masks, each layer's RoPE base in re-rotation, q/k norm, "
           "scaled embeddings and the norms around both sublayers (SGLang's model; the reference loop's own code)"),
    Family("DeepSeek V2/V3 (MLA)", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), (),
           "multi-head latent attention: the pool holds a compressed latent and a shared RoPE key, not per-head K/V"),
)

_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}


def family_of(config: Any) -> Family | None:
    for name in getattr(config, "architectures", None) or ():
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    return None


def check(config: Any, path: str = "sglang", context_len: int | None = None) -> RopeSpec:
    """The model's RoPE if chunk reuse can blend it on `path` (of PATHS); else UnsupportedModel with the reason.
    `context_len`: the longest prompt served (default: the model's `max_position_embeddings`)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    archs = list(getattr(config, "architectures", None) or ())
    family = family_of(config)
    if family is None:
        raise UnsupportedModel(f"architecture {'/'.join(archs) or '(none in config.json)'} is not in chunkcache's "
                               f"support table (README 'Models'); chunk reuse supports "
                               f"{', '.join(f.name for f in FAMILIES if f.paths)}")
    what = f"{family.name} ({archs[0]})"
    if path not in family.paths:
        where = f" (it is blended on the {' and '.join(family.paths)} path)" if family.paths else ""
        raise UnsupportedModel(f"{what} is not supported for chunk reuse on the {path} path{where}: {family.note}")
    problem = next(_features(config, path, context_len or getattr(config, "max_position_embeddings", None)), None)
    if problem:
        raise UnsupportedModel(f"{what} with {problem}: chunk reuse would serve it wrong")
    try:
        return RopeSpec.from_config(config)
    except UnsupportedRope as exc:
        raise UnsupportedModel(f"{what}: {exc}") from exc


def _features(config: Any, path: str, context_len: int | None):
    """What an accepted family's config may still switch on that the blend does not compute. On the SGLang path the
    blend reads each layer's sliding window from SGLang's attention layer; the reference loop reads it from
    transformers' attention module, which holds it only where the config gives windows per layer type
    (`layer_types`: Gemma 3, Qwen2/3), not a model-wide one (Mistral)."""
    window = getattr(config, "sliding_window", None)
    use_window = getattr(config, "use_sliding_window", True)  # Qwen2/3 carry a window they do not use by default
    per_layer = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if path == "reference" and window and use_window and not per_layer and (context_len is None or
                                                                            window < context_len):
        yield (f"a sliding window of {window} tokens (context {context_len}) for the whole model: the reference path "
               f"takes windows per layer type only")
    if getattr(config, "attn_logit_softcapping", None):
        yield (f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}): the blend's "
               f"attention does not cap")
