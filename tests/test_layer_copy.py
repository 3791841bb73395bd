"""chunkcache.blend.layer_copy: the chunk KV copy that runs behind the pass on CUDA. Off CUDA every layer is written
before anything reads the pool; on CUDA a reader that waits for layer i sees layer i's copy complete even
when the side stream is far behind (it is held back here with a device sleep), and one that does not wait would not
(the premise, checked, so that the waits are what the test shows)."""

import pytest
import torch

from chunkcache.blend.layer_copy import LayerCopy
from chunkcache.rope import RopeSpec, Rotation, rerotate


def test_off_cuda_every_layer_is_written_in_order_before_it_returns():
    calls = []
    copied = LayerCopy(5, torch.device("cpu"), calls.append)
    assert calls == list(range(5))
    copied.wait(3), copied.wait_all()  # nothing left to wait for


def test_a_rotation_of_one_layer_moves_its_keys_as_rerotate_moves_all_of_them():
    per_layer = RopeSpec("default+nope", torch.rand(3, 4), 8)  # 3 layers, head_dim 8
    k, moved, at = torch.randn(3, 5, 2, 8), torch.tensor([7, 7, 7, -2, -2]), torch.arange(5)
    rotation = Rotation.of(moved, per_layer, at)
    assert torch.equal(torch.stack([rotation.layer(i).apply(k[i]) for i in range(3)]),
                       rerotate(k, moved, per_layer, at))
    shared = RopeSpec("default", torch.rand(4), 8)
    assert torch.equal(Rotation.of(moved, shared, at).layer(1).apply(k[1]), rerotate(k, moved, shared, at)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_reader_that_waits_sees_each_layer_whole_while_the_copy_runs_behind():
    layers, n = 4, 1 << 20
    source = torch.arange(layers * n, dtype=torch.float32).view(layers, n).pin_memory()
    pool = torch.zeros(layers, n, device="cuda")

    def write(layer: int) -> None:
        torch.cuda._sleep(50_000_000)  # ~25 ms per layer on the side stream
        pool[layer] = source[layer].to("cuda", non_blocking=True)

    unwaited = LayerCopy(layers, torch.device("cuda"), write)  # layers 0 and 1 queued, behind the sleeps
    assert pool[1].sum().item() == 0, "the copy finished before the reader: the waits are not tested"
    unwaited.wait_all()
    pool.zero_()
    copied = LayerCopy(layers, torch.device("cuda"), write)
    seen = []
    for layer in range(layers):
        copied.wait(layer)
        seen.append(pool[layer].clone())  # on the caller's stream, after the wait
    assert all(torch.equal(s.cpu(), source[i]) for i, s in enumerate(seen))
