"""A device tensor that another stream reads is recorded on that stream (Tensor.record_stream), so that
the caching allocator does not give its memory to the stream that made it before the read has run.
The gradient buffer of a block is made on the compute stream and read on the D2H stream (its cast to
bf16, its copies, its reductions); the next block's buffer, the same size, is made on the compute
stream right after. On a GPU the race cannot be forced from a test; these stand-ins check the calls."""

import contextlib
import types

import torch

from slidedp.backend.runtime.routes import Routes


class _DeviceTensor:
    """What the routes read of a CUDA tensor, and the streams it is recorded on."""

    is_cuda = True

    def __init__(self, dtype, log):
        self.dtype, self.log = dtype, log

    def record_stream(self, stream):
        self.log.append(("record", stream))

    def to(self, dtype):
        self.log.append(("cast", dtype))
        return _DeviceTensor(dtype, [])

    def __getitem__(self, index):  # a view: its storage is the buffer's
        return self


def _streams(log):
    return types.SimpleNamespace(d2h="d2h", on=lambda name: contextlib.nullcontext(),
                                 copy=lambda name, dst, src: log.append(("copy", name)))


def test_the_cast_to_the_host_dtype_records_its_source_on_the_d2h_stream():
    log = []
    routes = types.SimpleNamespace(streams=_streams(log))
    Routes._copy_down(routes, torch.empty(4, dtype=torch.bfloat16), _DeviceTensor(torch.float32, log))
    assert log[:2] == [("record", "d2h"), ("cast", torch.bfloat16)] and log[-1] == ("copy", "d2h")


def test_every_route_of_a_gradient_has_it_recorded_on_the_d2h_stream_first():
    log = []
    taken = []
    routes = types.SimpleNamespace(streams=_streams(log), device_state=None, grads_streamed={3},
                                   _stream_gradient=lambda layer_id, acc, sumsq: taken.append(layer_id))
    Routes.gradient(routes, 3, _DeviceTensor(torch.float32, log), None)
    assert log == [("record", "d2h")] and taken == [3]


class _Event:
    """A CUDA event stand-in: what it was recorded after, and its synchronizations in the log."""

    def __init__(self, after, log):
        self.after, self.log = after, log

    def synchronize(self):
        self.log.append(("sync", self.after))


def test_a_blocks_backward_waits_on_the_cpu_for_the_gradient_buffer_it_replaces(monkeypatch):
    """The caching allocator reuses a gradient buffer read on the D2H stream only once the CPU has seen
    that read end: before each backward from the third block on, the executor synchronizes the copy of
    the gradient two blocks earlier (the plan's two buffers), so the CPU does not run ahead of the copies
    and the allocator does not reserve a new buffer per block."""
    import slidedp
    from tests.engine.test_exactness import BATCH, SEQ, random_batch
    from tests.models import make_model

    model = make_model("llama")
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=1e-3))
    executor = engine.executor
    n = executor.n_blocks
    assert n >= 3
    log = []
    monkeypatch.setattr(executor.streams, "record", lambda name: _Event(log[-1] if log else None, log))
    backward, send = executor.block_runner.backward, executor._op_d2h_grad

    def logged_backward(k, *args):
        log.append(("bwd", k))
        return backward(k, *args)

    def logged_send(op, st):
        log.append(("d2h", op.layer_id))
        return send(op, st)

    monkeypatch.setattr(executor.block_runner, "backward", logged_backward)
    monkeypatch.setattr(executor, "_op_d2h_grad", logged_send)
    engine.step(*random_batch(torch.Generator().manual_seed(0), BATCH))
    layer_of = [layer.id for layer in executor.block_layers]
    for k in range(n - 1, -1, -1):
        i = log.index(("bwd", k))
        synced = [entry[1] for entry in log[log.index(("bwd", k + 1)) if k + 1 < n else 0 : i] if entry[0] == "sync"]
        if k + 2 < n:
            assert ("d2h", layer_of[k + 2]) in synced, (k, synced)
        else:  # the first two of the backward: nothing to replace
            assert not any(after and after[0] == "d2h" and after[1] in layer_of for after in synced), (k, synced)
