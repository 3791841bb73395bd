"""Stored chunk KV written into a KV pool layer by layer, behind the pass that reads it.

On a CUDA device the writes run on a side stream, in layer order, one event after each layer: a pass waits for layer
i's event only where layer i's attention reads the pool, so the host-to-device copy (and re-rotation, and a
compressed entry's decoding) of layer i + 1 runs while layer i computes. Elsewhere there is no second stream and
everything is written at once, before the pass: nothing to overlap, and one call keeps the host's loop short.

The contract:
- `write(layers)` writes the stored KV of the layers in the slice `layers` (every layer in one call off CUDA, one
  layer per call on CUDA); it is called on the side stream, so what it allocates stays on that stream.
- The side stream starts after the work already queued on the caller's stream (the pool's slots may have been
  written by it), and `wait(i)` orders the caller's stream after layer i's writes. A reader waits before it reads
  layer i and before it writes fresh K/V over copied slots; `wait_all()` before anything else touches the pool (a
  fallback's stock prefill, a request freed).
"""

from __future__ import annotations

from typing import Callable

import torch


class LayerCopy:
    def __init__(self, n_layers: int, device: torch.device, write: Callable[[slice], None]):
        self.events: list[torch.cuda.Event] = []
        if device.type != "cuda":
            write(slice(0, n_layers))
            return
        stream, caller = torch.cuda.Stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for layer in range(n_layers):
                write(slice(layer, layer + 1))
                self.events.append(torch.cuda.Event())
                self.events[-1].record(stream)

    def wait(self, layer: int) -> None:
        """The caller's stream runs after layer `layer`'s writes (no wait off CUDA: they are done)."""
        if self.events:
            torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        if self.events:
            self.wait(len(self.events) - 1)  # one stream, in layer order: the last event follows every write
