"""SGLang's unquantized linear layers with their bfloat16 weights reordered for oneDNN once, on a CPU without AMX.

There SGLang's linear layer is `F.linear`, which reorders the weight into oneDNN's blocked layout on every call (SGLang
prepacks only where AMX runs its own kernel). Reordered once at load, the same oneDNN kernel computes the same bits
and skips the reorder (docs/what-runs.md: the default model decodes ~20 % faster). A layer is packed only where probe
inputs give `F.linear`'s output bit for bit.

The layer keeps its weight (what weight loaders, `get_weights_by_name` and the layer's other readers see); the packed
copy is derived from it, so an online weight update would leave the copy stale: a packed layer refuses them (SGLang's
`_derived_weight_cache_error`, which every update path checks over the model's modules before it writes).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

log = logging.getLogger(__name__)

# the row count oneDNN picks the packed layout for; any other count runs on it unchanged (measured 1-1,000 rows)
PACK_ROWS = 64
# row counts a packed weight is checked at: oneDNN picks its kernel by them (one row: decoding; a few: a blend's query
# pass; tens to hundreds: recompute passes and prefills)
PROBE_ROWS = (1, 5, 67, 333)
UPDATES_REFUSED = ("chunkcache: online weight updates are refused while the linear layers' weights are prepacked "
                   "(serve.cpu_linear: packed): the packed copies would keep serving the old weights. Restart with "
                   "the new weights, or with serve.cpu_linear: sglang")


class PackedLinearMethod(UnquantizedLinearMethod):
    """UnquantizedLinearMethod over the layer's packed weight (`layer.packed_weight`)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.packed(x, layer.packed_weight, bias)

    @staticmethod
    def packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias with `weight` reordered by `_reorder`."""
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def packable(layer: torch.nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return (isinstance(layer, LinearBase) and type(layer.quant_method) is UnquantizedLinearMethod
            and not getattr(layer, "use_intel_amx_backend", False) and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu")


def pack(model: torch.nn.Module) -> int:
    """Packs every packable linear layer of `model` whose packed weight computes F.linear's bits (probed once per
    weight shape at PROBE_ROWS, with the layer's bias and without); returns how many. A packed layer refuses the
    model's online weight updates."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed, extra, same = 0, 0, {}
    for layer in model.modules():
        if not packable(layer):
            continue
        weight = layer.weight.detach()
        candidate = _reorder(weight)
        bias = getattr(layer, "bias", None)
        shape = (tuple(weight.shape), bias is not None)
        if shape not in same:
            same[shape] = _same_bits(weight, candidate, bias)
            if not same[shape]:
                log.warning("chunkcache: a packed %s weight computes other bits than F.linear; such layers are left "
                            "to SGLang", tuple(weight.shape))
        if not same[shape]:
            continue
        layer.packed_weight = candidate
        layer.quant_method = PackedLinearMethod()
        layer._derived_weight_cache_error = UPDATES_REFUSED
        packed += 1
        extra += candidate.numel() * candidate.element_size()
    if packed:
        log.info("chunkcache: %d linear layers' weights prepacked for oneDNN (%.0f MiB beside the weights)",
                 packed, extra / 2**20)
    return packed


def _same_bits(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    gen = torch.Generator().manual_seed(0)
    biases = (None,) if bias is None else (None, bias.detach())
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
        if not all(torch.equal(PackedLinearMethod.packed(x, packed, b), F.linear(x, weight, b)) for b in biases):
            return False
    return True
