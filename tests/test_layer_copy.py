"""chunkcache.blend.layer_copy: the chunk KV copy that runs behind the pass on CUDA. Off CUDA every layer is written
at once, before anything reads the pool; on CUDA a reader that waits for layer i sees layer i's copy complete even
when the side stream is far behind (it is held back here with a device sleep), and one that does not wait would not
(the premise, checked, so that the waits are what the test shows)."""

import pytest
import torch

from chunkcache.blend.layer_copy import LayerCopy
from chunkcache.rope import RopeSpec


def test_off_cuda_every_layer_is_written_in_one_call_before_it_returns():
    calls = []
    copied = LayerCopy(5, torch.device("cpu"), calls.append)
    assert calls == [slice(0, 5)]
    copied.wait(3), copied.wait_all()  # nothing left to wait for


def test_a_per_layer_spec_keeps_the_rows_of_its_layers():
    per_layer = RopeSpec("default+nope", torch.arange(12.).view(3, 4), 8)
    assert torch.equal(per_layer.layers(slice(1, 2)).inv_freq, torch.tensor([[4., 5., 6., 7.]]))
    shared = RopeSpec("default", torch.arange(4.), 8)
    assert shared.layers(slice(1, 2)) is shared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_reader_that_waits_sees_each_layer_whole_while_the_copy_runs_behind():
    layers, n = 4, 1 << 20
    source = torch.arange(layers * n, dtype=torch.float32).view(layers, n).pin_memory()
    pool = torch.zeros(layers, n, device="cuda")

    def write(which: slice) -> None:
        torch.cuda._sleep(50_000_000)  # ~25 ms per layer on the side stream
        pool[which] = source[which].to("cuda", non_blocking=True)

    unwaited = LayerCopy(layers, torch.device("cuda"), write)
    assert pool[layers - 1].sum().item() == 0, "the copy finished before the reader: the waits are not tested"
    unwaited.wait_all()
    pool.zero_()
    copied = LayerCopy(layers, torch.device("cuda"), write)
    seen = []
    for layer in range(layers):
        copied.wait(layer)
        seen.append(pool[layer].clone())  # on the caller's stream, after the wait
    assert all(torch.equal(s.cpu(), source[i]) for i, s in enumerate(seen))
