"""A device tensor that another stream reads is recorded on that stream (Tensor.record_stream), so that
the caching allocator does not give its memory to the stream that made it before the read has run.
A gradient is made on the compute stream and read on the D2H stream (its cast to bf16, its copies,
its reductions). The blocks' gradient buffers are kept instead and refilled only after the compute
stream has waited for their copies (grad_buffers.py). On a GPU the race cannot be forced from a test;
these stand-ins check the calls."""

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


def test_the_blocks_gradient_buffers_are_two_kept_and_each_refilled_after_its_copy_drained(monkeypatch):
    """The plan's two gradient buffers, kept across blocks and steps: each block's backward fills one, the
    compute stream having waited for the event recorded after the copy of the gradient it held last (the
    block two backwards earlier, or in the step before); the caching allocator hands out no buffer per
    block, so it cannot reserve one per block the CPU runs ahead of the copies."""
    import slidedp
    from slidedp.costmodel.memory import GRAD_ACCUMULATORS
    from tests.engine.test_exactness import BATCH, SEQ, random_batch
    from tests.models import make_model

    model = make_model("llama")
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=1e-3))
    executor = engine.executor
    runner = executor.block_runner
    n = executor.n_blocks
    assert n >= 3
    log, made = [], []

    def record(name):
        made.append((name, log[-1] if log else None))  # what the event comes after
        return types.SimpleNamespace(id=len(made) - 1, synchronize=lambda: None)

    monkeypatch.setattr(executor.streams, "record", record)
    monkeypatch.setattr(executor.streams, "wait", lambda name, event: log.append(("wait", name, event)))
    take, send = runner.grads.take, executor._op_d2h_grad

    def logged_take(layer_id, numel):
        buffer = take(layer_id, numel)
        log.append(("take", layer_id, buffer.data_ptr()))
        return buffer

    def logged_send(op, st):
        log.append(("sent", op.layer_id))
        return send(op, st)

    monkeypatch.setattr(runner.grads, "take", logged_take)
    monkeypatch.setattr(executor, "_op_d2h_grad", logged_send)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        engine.step(*random_batch(gen, BATCH))
    takes = [i for i, entry in enumerate(log) if entry[0] == "take"]
    assert len(takes) == 2 * n and len({log[i][2] for i in takes}) == GRAD_ACCUMULATORS
    for j, i in enumerate(takes):
        waited = log[i - 1]
        if j < GRAD_ACCUMULATORS:  # the first two of the first step: nothing to wait for
            assert waited == ("wait", "compute", None)
            continue
        before = log[takes[j - GRAD_ACCUMULATORS]][1]  # the layer whose gradient the buffer held
        assert waited[:2] == ("wait", "compute") and made[waited[2].id] == ("d2h", ("sent", before))
        assert log[i][2] == log[takes[j - GRAD_ACCUMULATORS]][2]
