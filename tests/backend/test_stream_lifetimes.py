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


class _Tensor:
    """A stand-in tensor that logs its casts, moves and copies."""

    def __init__(self, dtype, is_cuda, log, name):
        self.dtype, self.is_cuda, self.log, self.name = dtype, is_cuda, log, name
        self.device = "cuda" if is_cuda else "cpu"

    def to(self, where, non_blocking=False):
        if isinstance(where, torch.dtype):
            self.log.append(("cast", self.name, where))
            return _Tensor(where, self.is_cuda, self.log, self.name + "'")
        self.log.append(("move", self.name, where, non_blocking))
        return _Tensor(self.dtype, where == "cuda", self.log, self.name + "'")

    def copy_(self, src, non_blocking=False):
        self.log.append(("copy", self.name, src.name, src.dtype, src.is_cuda, non_blocking))

    def record_stream(self, stream):
        self.log.append(("record", self.name, stream))


def test_a_copy_between_host_and_device_in_two_dtypes_casts_on_the_device(monkeypatch):
    """Streams.copy: the fp32 master into a bf16 slot (a delivery copy made on load) lands in fp32 on the
    device and is cast there, and a device tensor going down in another dtype is cast before it leaves
    (torch's copy_ would cast on the CPU through pageable memory); a copy in one dtype is left alone."""
    from slidedp.backend.runtime.streams import Streams

    streams = Streams(torch.device("cpu"))
    streams.cuda, streams.h2d, streams.d2h = True, "h2d", "d2h"
    monkeypatch.setattr(Streams, "on", lambda self, name: contextlib.nullcontext())
    log = []
    streams.copy("h2d", _Tensor(torch.bfloat16, True, log, "slot"), _Tensor(torch.float32, False, log, "master"))
    assert log[0] == ("move", "master", "cuda", True)
    assert log[1] == ("copy", "slot", "master'", torch.float32, True, True)  # cast on the device
    assert {entry[1] for entry in log[2:]} == {"slot", "master'"}  # both recorded on the stream
    log.clear()
    streams.copy("d2h", _Tensor(torch.bfloat16, False, log, "host"), _Tensor(torch.float32, True, log, "grad"))
    assert log[0] == ("cast", "grad", torch.bfloat16)
    assert log[1] == ("copy", "host", "grad'", torch.bfloat16, True, True)
    log.clear()
    streams.copy("h2d", _Tensor(torch.bfloat16, True, log, "slot"), _Tensor(torch.bfloat16, False, log, "copy"))
    assert log[0] == ("copy", "slot", "copy", torch.bfloat16, False, True) and not any(e[0] in ("move", "cast")
                                                                                         for e in log)
