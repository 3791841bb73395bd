"""Stored chunk KV written into a KV pool layer by layer, behind the pass that reads it.

On a CUDA device the writes run on a side stream, one layer at a time, each followed by an event, and are queued
lazily: layers 0 and 1 at the start, layer i + 2 when a pass waits for layer i. So the host
queues layer i + 1's copy between layer i's kernels, not all layers' before the pass's first kernel (the host's
queueing would otherwise delay the pass by as much as the overlap saves), and the device copies (and re-rotates,
and decodes a compressed entry of) layer i + 1 while layer i computes. Elsewhere there is no second stream and
every layer is written before the constructor returns, still one layer per call: a layer of every chunk fits a CPU's
caches where every layer of them does not (re-rotating a 3K-token prompt's 30 layers in one call took 4x as long as
layer by layer on a Zen 4).

The contract:
- `write(layer)` writes one layer's stored KV, on CUDA on the side stream, so what it allocates stays on that
  stream.
- The side stream starts after the work already queued on the caller's stream (the pool's slots may have been
  written by it), and `wait(i)` orders the caller's stream after layer i's writes. A reader waits before it reads
  layer i and before it writes fresh K/V over copied slots.
- `wait_all()` queues what is left and orders the caller's stream after all of it: before anything else touches
  the pool (a fallback's stock prefill, the next batch), and at the latest when the blend ends, or layers no pass
  waited for would never be written.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every copy: the caching allocator keeps blocks per stream, so a new stream per
    blend would allocate afresh (cudaMalloc, which waits for the whole device) where a reused one finds its blocks."""
    return torch.cuda.Stream(device)


AHEAD = 1  # layers queued beyond the one a pass waits for


class LayerCopy:
    def __init__(self, n_layers: int, device: torch.device, write: Callable[[int], None]):
        self.n_layers, self.write = n_layers, write
        self.events: list[torch.cuda.Event] = []
        self.stream = copy_stream(device) if device.type == "cuda" else None
        if self.stream is None:
            for layer in range(n_layers):
                write(layer)
            return
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self._queue(1 + AHEAD)

    def _queue(self, upto: int) -> None:
        with torch.cuda.stream(self.stream):
            while len(self.events) < min(upto, self.n_layers):
                self.write(len(self.events))
                self.events.append(torch.cuda.Event())
                self.events[-1].record(self.stream)

    def wait(self, layer: int) -> None:
        """The caller's stream runs after layer `layer`'s writes (no wait off CUDA: they are done)."""
        if self.stream is not None:
            self._queue(layer + 2 + AHEAD)
            torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        if self.stream is not None:
            self.wait(self.n_layers - 1)  # one stream, in layer order: the last event follows every write
