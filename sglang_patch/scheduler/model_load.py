"""The loaded model of a chunkcache server: online weight updates refused, linear weights prepacked on a CPU."""

from __future__ import annotations

import os

from ..forward import packed_linear
from ..serve.launcher import BACKEND_NAME, CPU_LINEAR_ENV

# the chunk store's KV was computed with the loaded weights, and its keys name the model, not its weights: an online
# update would leave every stored chunk serving the old model's KV
STORE_OUTLIVES_UPDATES = ("chunkcache: online weight updates are refused under chunk reuse: the chunk store holds KV "
                          "computed with the loaded weights. Restart the server with the new weights")


def loaded_model(result, runner, *args, **kwargs) -> None:
    """AFTER hook on ModelRunner.load_model. Every update path of SGLang checks `_derived_weight_cache_error` over
    the model's modules before it writes."""
    if runner.server_args.radix_cache_backend == BACKEND_NAME:
        runner.model._derived_weight_cache_error = STORE_OUTLIVES_UPDATES
    if os.environ.get(CPU_LINEAR_ENV) == "packed" and runner.device == "cpu":
        packed_linear.pack(runner.model)
