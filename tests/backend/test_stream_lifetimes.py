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
