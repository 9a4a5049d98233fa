"""The optimizer state of the layers the plan keeps on the device (`plan.device_state`: any set of
layers with parameters, chosen per layer by the planner).

For these layers the device holds the fp32 master weights, both AdamW moments and the step's
gradient (in the host gradient's dtype). A step then moves nothing of them over PCIe: the weight
"load" into a slot is a copy within the device that casts the master to the compute dtype (round
to nearest even, as the CPU optimizer writes the host's delivery copy), the gradient stays there,
and once the step's norm is known (rank.py) AdamW runs on the device's update stream, layer by
layer in the order the next forward needs them, beside that forward: each layer's next load and
next gradient copy wait for its update by an event (`ready`).

An engine's own rank (one rank) keeps nothing of these layers on the host ("lean" layers,
host_state.py): the initial weights are loaded into the device's master (`param_views`), and
`state_dict`, exports, the model's parameters and checkpoints read and write the arrays here
(`arrays`), through a bounded host staging buffer (staging.py). With several ranks the host keeps
their whole state as the place those read: `store_to_host` copies master and moments down (the
engine's `sync_host`), `load_from_host` up (at the start, and after a checkpoint was loaded into
the host).

AdamW is `torch._fused_adamw_` (the kernel of `torch.optim.AdamW(fused=True)`, on CUDA and on the
CPU) on pieces of `piece_numel` parameters, each with its gradient taken to fp32 and multiplied by
the clip coefficient first, as the CPU optimizer does (backend/kernels/cpu_adamw.py).

Sharded (`owned`: several ranks, plan.device_state_sharded): a rank keeps master, moments and
gradient only of the chunks it owns, packed one after another (`DeviceLayer.shards`: (start, end,
offset) of each), and updates only them; loads and the gradient go through routes.py (all-gather of
the owners' weights, reduce-scatter onto the owners). `store_to_host` and `load_from_host` copy each
rank's own chunks, so every rank calls them and the shared host state holds the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.backend.state.host_state import HostState
from slidedp.costmodel.memory import DEVICE_STATE_PIECE_NUMEL
from slidedp.optim import AdamW


@dataclass
class DeviceLayer:
    master: torch.Tensor  # fp32; what the slots copy, cast to the compute dtype
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # this step's gradient, in the host gradient's dtype
    shards: tuple[tuple[int, int, int], ...]  # (start, end, offset here) of each range kept: the layer, or owned chunks

    def at(self, lo: int, hi: int) -> int:
        """Offset here of the kept range [lo, hi) of the layer."""
        return next(off for a, b, off in self.shards if (a, b) == (lo, hi))


class DeviceState:
    def __init__(self, host: HostState, layer_ids, *, device: torch.device, piece_numel: int = DEVICE_STATE_PIECE_NUMEL,
                 owned: dict[int, list[tuple[int, int]]] | None = None):
        """`owned` (sharded): {layer id: the (start, end) chunks this rank keeps}; None: whole layers."""
        self.host, self.device, self.piece_numel = host, device, piece_numel
        self.sharded = owned is not None
        self.layers: dict[int, DeviceLayer] = {}
        self.ready: dict[int, torch.cuda.Event | None] = {}  # each layer's last update, recorded where it ran
        self.lean = frozenset(i for i in layer_ids if host.layers[i].layout.lean)  # nothing of them on the host
        if self.sharded and self.lean:
            raise ValueError("sharded device state needs the host to keep the layers (several ranks)")
        for layer_id in layer_ids:
            arrays = host.layers[layer_id]
            ranges = owned[layer_id] if self.sharded else [(0, arrays.layout.numel)]
            shards, n = [], 0
            for lo, hi in ranges:
                shards.append((lo, hi, n))
                n += hi - lo
            master = torch.empty(n, dtype=torch.float32, device=device)
            self.layers[layer_id] = DeviceLayer(master, torch.zeros_like(master), torch.zeros_like(master),
                                                torch.empty(n, dtype=arrays.grad.dtype, device=device),
                                                tuple(shards))
        self.load_from_host()

    @property
    def nbytes(self) -> int:
        """Bytes of every array kept on the device (master, moments, gradient)."""
        return sum(t.numel() * t.element_size() for d in self.layers.values()
                   for t in (d.master, d.exp_avg, d.exp_avg_sq, d.grad))

    def __contains__(self, layer_id: int) -> bool:
        return layer_id in self.layers

    def _pairs(self, d: DeviceLayer, arrays):
        """(device, host) tensors kept in both places: master and moments of each kept range, none for
        a lean layer."""
        if arrays.layout.lean:
            return []
        return [(here[off:off + hi - lo], there[lo:hi]) for lo, hi, off in d.shards
                for here, there in ((d.master, arrays.master), (d.exp_avg, arrays.exp_avg),
                                    (d.exp_avg_sq, arrays.exp_avg_sq))]

    def wait_updates(self) -> None:
        """The current stream waits (on the device) until every started update has run."""
        for event in self.ready.values():
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def arrays(self, layer_id: int) -> dict[str, torch.Tensor]:
        """The layer's flat fp32 master, exp_avg and exp_avg_sq on the device, once every started
        update has run (what checkpoints of lean layers read and write)."""
        if self.sharded:
            raise ValueError("a sharded device state holds only this rank's chunks: read the host state")
        self.wait_updates()
        self._synchronize()
        d = self.layers[layer_id]
        return {"master": d.master, "exp_avg": d.exp_avg, "exp_avg_sq": d.exp_avg_sq}

    def param_views(self, layer_id: int) -> dict[str, torch.Tensor]:
        """{parameter name: view of the device's fp32 master} of one layer (its updates done)."""
        master = self.arrays(layer_id)["master"]
        return self.host.layers[layer_id].param_views(master)

    def load_from_host(self) -> None:
        """The host's master weights and moments onto the device, lean layers' excepted (synchronous)."""
        self._synchronize()
        for layer_id, d in self.layers.items():
            for dst, src in self._pairs(d, self.host.layers[layer_id]):
                dst.copy_(src)
        self._synchronize()

    def store_to_host(self) -> None:
        """The device's master weights and moments into the host state, and its delivery copy (lean
        layers: nothing, the host keeps none of them; synchronous)."""
        self._synchronize()
        for layer_id, d in self.layers.items():
            arrays = self.host.layers[layer_id]
            if arrays.layout.lean:
                continue
            for src, dst in self._pairs(d, arrays):
                dst.copy_(src)
            if arrays.delivery is not None:  # round to nearest even, as the CPU optimizer writes it
                for lo, hi, _ in d.shards:
                    arrays.delivery[lo:hi].copy_(arrays.master[lo:hi])

    def update(self, layer_id: int, segments, opt: AdamW, *, step: int, clip: float) -> None:
        """AdamW of one layer's kept ranges on the current stream; `segments` are its (start, end,
        decay) runs, in the layer's coordinates."""
        d = self.layers[layer_id]
        # a fill on the device: a tensor from a host scalar would wait for the stream's earlier work
        steps = [torch.full((), float(step), dtype=torch.float32, device=self.device)]
        for first, last, off in d.shards:
            for start, end, decay in segments:
                a, b = max(first, start) - first + off, min(last, end) - first + off
                for lo in range(a, b, self.piece_numel):
                    hi = min(lo + self.piece_numel, b)
                    adamw_piece_(d.master[lo:hi], d.exp_avg[lo:hi], d.exp_avg_sq[lo:hi], d.grad[lo:hi], steps,
                                 opt, decay=decay, clip=clip)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    synchronize = _synchronize  # what was written into the device's arrays is there for every stream


def adamw_piece_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                 steps: list[torch.Tensor], opt: AdamW, *, decay: bool = True, clip: float = 1.0) -> None:
    """AdamW of one piece in place: its gradient to fp32 times `clip`, then the fused kernel
    (`steps`: [the 1-based step as a float tensor on the device]). What `slidedp calibrate` times."""
    g = grad.float()
    if clip != 1.0:
        g.mul_(clip)
    torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], steps, lr=opt.lr, beta1=opt.betas[0],
                        beta2=opt.betas[1], weight_decay=opt.weight_decay if decay else 0.0, eps=opt.eps,
                        amsgrad=False, maximize=False)
