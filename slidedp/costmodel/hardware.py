"""Hardware profiles: what the step-time model needs to know about a host and its GPUs.

`h200-sxm` is measured (docs/design.md §6.2) and fitted to whole steps; the other presets derive
from vendor figures and typical hosts (docs/design.md §6.3). How each fit was made:
benchmarks/LOG.md, "Cost-model coefficients".
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path

from slidedp.logs import warn_once

# H2D efficiency by copy size as (bytes, fraction of the large-copy bandwidth), measured on the H200
# host (docs/design.md §6.2: 2.4 GB/s at 64 KiB up to 54 at 64 MiB, against 55 for large copies).
# Other hosts scale the same curve to their own bandwidth until calibrated.
H200_TRANSFER_EFFICIENCY: tuple[tuple[int, float], ...] = (
    (64 * 2**10, 2.4 / 55), (2**20, 30 / 55), (4 * 2**20, 46 / 55), (16 * 2**20, 52 / 55),
    (64 * 2**20, 54 / 55), (2**30, 1.0),
)


@dataclass(frozen=True)
class Hardware:
    name: str
    gpu_memory_bytes: int
    matmul_flops_per_s: float  # dense bf16 rate reached by large matmuls
    block_efficiency: float  # fraction of matmul_flops_per_s a transformer block reaches
    h2d_bytes_per_s: float  # pinned, one direction, per GPU
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float  # H2D + D2H at once, per GPU
    host_dram_bytes_per_s: float  # host memory copy bandwidth, all cores
    cpu_adamw_params_per_s: float  # CPU AdamW throughput, all cores, bf16 weights written
    cpu_adamw_contended_fraction: float  # fraction left while DMA runs both ways
    cpu_cores: int
    gpu_p2p_bytes_per_s: float  # GPU-to-GPU, 0 without peer-to-peer
    gpus_per_root_complex: int = 1
    # (transfer bytes, fraction of h2d/d2h_bytes_per_s reached), increasing sizes; see ops.py
    transfer_efficiency: tuple[tuple[int, float], ...] = H200_TRANSFER_EFFICIENCY
    # (threads, params/s) of the CPU AdamW by increasing thread count, as measured by `slidedp
    # calibrate`; empty for presets. cpu_adamw_params_per_s is the best of them.
    cpu_adamw_params_per_s_by_threads: tuple[tuple[int, float], ...] = ()
    # Host (Python) time to issue one transformer block's forward, and its backward without
    # recompute, for one micro-batch: a block's compute takes at least this long however fast the
    # GPU is (ops.block_forward_time_s); 0 ignores the host. Measured per model family and host.
    host_block_fwd_s: float = 0.0
    host_block_bwd_s: float = 0.0
    # Fraction of matmul_flops_per_s that the head + loss (fused linear + cross-entropy) reaches;
    # 0: block_efficiency.
    head_efficiency: float = 0.0
    # Fraction of matmul_flops_per_s that a block run through torch.compile reaches (forward,
    # recompute and backward); 0: not measured, the eager figures above apply.
    compiled_block_efficiency: float = 0.0
    # The engine's host time to issue one micro-batch's compiled forward of a block, and its backward
    # (without recompute), as `slidedp calibrate` times it in the steps of a model narrow enough that the
    # device keeps up: a compiled block takes at least this long (ops.block_forward_time_s). 0: not
    # measured, no floor.
    host_compiled_fwd_s: float = 0.0
    host_compiled_bwd_s: float = 0.0
    # Device memory bandwidth reached by an optimizer kernel (reads and writes together); 0: not
    # known, and the optimizer state of a layer is never planned on the device (ops.device_update_time_s).
    gpu_memory_bytes_per_s: float = 0.0
    # Fraction of cpu_adamw_params_per_s left to early updates (scheduler/search/early_order.py), which run
    # beside the backward's gradient and weight copies both ways and write their result beside their inputs
    # (out of place; `slidedp calibrate` measures that while copies run both ways); 0: cpu_adamw_contended_fraction.
    cpu_adamw_backward_fraction: float = 0.0
    # Fraction of the duplex copy rate (H2D and D2H at once) left while the CPU AdamW runs on the host's
    # cores: both draw on host DRAM. Applied to the streamed updates' round trips, which run at the step
    # boundary beside the CPU's round of updates (scheduler/problem/costs.py); 0: not known, 1.
    duplex_contended_fraction: float = 0.0
    # Rate of the attention kernels (causal scaled-dot-product attention, forward and backward) on
    # the FLOPs slidedp.ir counts for them [FLOP/s]; the rest of a block runs at the block's rate.
    # 0: not measured, attention runs at the block's rate (which then covers it).
    attention_flops_per_s: float = 0.0

    def __post_init__(self):
        """Every field checked (ValueError naming it): the right type, finite, > 0 for a rate, size or
        count, >= 0 where the field's comment says 0 means "not known" or "none"."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"hardware field 'name' must be a non-empty string, got {self.name!r}")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, float) and math.isfinite(value) and value.is_integer():
                value = int(value)  # 1.41e11 in a JSON profile
                object.__setattr__(self, name, value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hardware field {name!r} must be a whole number >= 1, got {value!r}")
        for name, least in {**{n: "positive" for n in _POSITIVE_RATES}, **{n: "zero" for n in _ZERO_MEANS_UNKNOWN}}.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    value < 0 or (least == "positive" and value == 0):
                rule = "> 0" if least == "positive" else ">= 0 (0: not known / none)"
                raise ValueError(f"hardware field {name!r} must be a finite number {rule}, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in _FRACTIONS:
            if getattr(self, name) > 1:
                raise ValueError(f"hardware field {name!r} is a fraction, at most 1, got {getattr(self, name)!r}")
        # JSON gives lists: keep the curve a tuple of pairs so profiles compare and hash alike.
        try:
            curve = tuple((_whole(b), float(f)) for b, f in self.transfer_efficiency)
        except (TypeError, ValueError):
            curve = ()
        if not curve or any(b <= 0 or not 0 < f <= 1 for b, f in curve) or \
                any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
            raise ValueError(f"hardware field 'transfer_efficiency' must be (bytes, fraction in (0, 1]) pairs by "
                             f"increasing size, got {self.transfer_efficiency!r}")
        object.__setattr__(self, "transfer_efficiency", curve)
        try:
            by_threads = tuple((_whole(t), float(r)) for t, r in self.cpu_adamw_params_per_s_by_threads)
        except (TypeError, ValueError):
            by_threads = ((0, 0.0),)
        if any(t < 1 or not 0 < r < math.inf for t, r in by_threads) or \
                any(a[0] >= b[0] for a, b in zip(by_threads, by_threads[1:])):
            raise ValueError(f"hardware field 'cpu_adamw_params_per_s_by_threads' must be (threads >= 1, params/s > 0) "
                             f"pairs by increasing threads, got {self.cpu_adamw_params_per_s_by_threads!r}")
        object.__setattr__(self, "cpu_adamw_params_per_s_by_threads", by_threads)

    def to_dict(self) -> dict:
        """JSON-native: the efficiency curve as lists, so a dict survives a JSON round trip unchanged."""
        data = asdict(self)
        data["transfer_efficiency"] = [list(point) for point in self.transfer_efficiency]
        data["cpu_adamw_params_per_s_by_threads"] = [list(p) for p in self.cpu_adamw_params_per_s_by_threads]
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "hardware profile") -> "Hardware":
        """A profile from its JSON mapping; errors name `where` (the file) and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a hardware profile is a JSON object, got {type(data).__name__}")
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"{where}: unknown hardware profile keys: {sorted(unknown)}")
        missing = [f.name for f in dataclass_fields(cls) if f.name not in data
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"{where}: hardware profile key(s) missing: {', '.join(map(repr, missing))}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Hardware":
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"hardware profile {path}: not UTF-8 text (at byte {exc.start})") from None
        except RecursionError:
            raise ValueError(f"hardware profile {path}: not a hardware profile JSON file (nested too deeply)") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"hardware profile {path}: not a hardware profile JSON file ({exc})") from None
        return cls.from_dict(data, where=f"hardware profile {path}")


def _whole(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(f"not a whole number: {value!r}")
    return int(value)


_POSITIVE_INTS = ("gpu_memory_bytes", "cpu_cores", "gpus_per_root_complex")
_POSITIVE_RATES = ("matmul_flops_per_s", "block_efficiency", "h2d_bytes_per_s", "d2h_bytes_per_s",
                   "duplex_bytes_per_s", "host_dram_bytes_per_s", "cpu_adamw_params_per_s",
                   "cpu_adamw_contended_fraction")
# 0 means "none" (no GPU peer-to-peer) or "not known" (the field's comment says which figure stands in)
_ZERO_MEANS_UNKNOWN = ("gpu_p2p_bytes_per_s", "host_block_fwd_s", "host_block_bwd_s", "head_efficiency",
                       "compiled_block_efficiency", "host_compiled_fwd_s", "host_compiled_bwd_s",
                       "gpu_memory_bytes_per_s", "cpu_adamw_backward_fraction", "attention_flops_per_s",
                       "duplex_contended_fraction")
# fractions of a rate left under contention (the efficiencies may exceed 1: calibrate measures them
# against one matmul's rate)
_FRACTIONS = ("cpu_adamw_contended_fraction", "cpu_adamw_backward_fraction", "duplex_contended_fraction")


GiB = 2**30

PRESETS: dict[str, Hardware] = {
    # Measured on one H200 host (docs/design.md §6.2) and fitted to measured steps (benchmarks/README.md).
    "h200-sxm": Hardware(
        name="h200-sxm",
        gpu_memory_bytes=141 * 10**9,  # [B] vendor capacity
        matmul_flops_per_s=786e12,  # [FLOP/s] bf16 8192^3 matmul, measured
        block_efficiency=0.4685,  # [fraction] fitted to measured Qwen3-4B block kernels, attention apart
        h2d_bytes_per_s=55e9,  # [B/s] pinned copy, one direction, measured
        d2h_bytes_per_s=55e9,  # [B/s] pinned copy, one direction, measured
        duplex_bytes_per_s=96e9,  # [B/s] H2D + D2H at once, measured
        host_dram_bytes_per_s=107e9,  # [B/s] 16-thread axpy, measured
        cpu_adamw_params_per_s=3.97e9,  # [params/s] fused CPU AdamW on 16 threads, measured
        cpu_adamw_contended_fraction=0.78,  # [fraction] CPU updates timed in steps beside a compute-bound forward
        cpu_cores=16,  # the host's cores
        gpu_p2p_bytes_per_s=450e9,  # [B/s] vendor NVLink figure, one direction (not measured)
        host_block_fwd_s=2.3e-3,  # [s] host time to issue an eager Qwen3-4B block's forward, measured
        host_block_bwd_s=6.0e-3,  # [s] the same for its backward, measured
        head_efficiency=0.67,  # [fraction] fused head + loss, benchmarks/head_kernel.py and step traces
        compiled_block_efficiency=0.652,  # [fraction] compiled passes at 16,384 / 65,536 tokens, fitted
        gpu_memory_bytes_per_s=3.0e12,  # [B/s] estimate: about 60% of the vendor's 4.8 TB/s
        attention_flops_per_s=540e12,  # [FLOP/s] causal SDPA fwd + bwd, benchmarks/block_rate.py
        cpu_adamw_backward_fraction=0.56,  # [fraction] fitted to two measured runs with early updates
        duplex_contended_fraction=0.76,  # [fraction] copies both ways under the CPU AdamW: 73 of 96 GB/s, measured
    ),
    # h100-sxm, a100-sxm, rtx4090: from vendor figures and a typical host of the class (docs/design.md §6.3).
    "h100-sxm": Hardware(
        name="h100-sxm", gpu_memory_bytes=80 * GiB, matmul_flops_per_s=750e12, block_efficiency=0.6,
        h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, duplex_bytes_per_s=90e9,
        host_dram_bytes_per_s=200e9, cpu_adamw_params_per_s=6e9, cpu_adamw_contended_fraction=0.66,
        cpu_cores=48, gpu_p2p_bytes_per_s=450e9,
        gpu_memory_bytes_per_s=2.5e12,
        duplex_contended_fraction=0.675,  # measured on an H100 host (16 cores): 69.7 -> 47.0 GB/s beside AdamW
    ),
    "a100-sxm": Hardware(
        name="a100-sxm", gpu_memory_bytes=80 * GiB, matmul_flops_per_s=280e12, block_efficiency=0.6,
        h2d_bytes_per_s=24e9, d2h_bytes_per_s=24e9, duplex_bytes_per_s=40e9,
        host_dram_bytes_per_s=150e9, cpu_adamw_params_per_s=5e9, cpu_adamw_contended_fraction=0.66,
        cpu_cores=64, gpu_p2p_bytes_per_s=300e9,
        gpu_memory_bytes_per_s=1.5e12,
    ),
    "rtx4090": Hardware(
        name="rtx4090", gpu_memory_bytes=24 * GiB, matmul_flops_per_s=150e12, block_efficiency=0.6,
        h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, duplex_bytes_per_s=40e9,
        host_dram_bytes_per_s=60e9, cpu_adamw_params_per_s=2e9, cpu_adamw_contended_fraction=0.66,
        cpu_cores=16, gpu_p2p_bytes_per_s=0.0, gpus_per_root_complex=2,
        gpu_memory_bytes_per_s=0.8e12,
    ),
    # The CPU "device" of tests and CI: compute on the host, copies are memcpy; nominal values.
    "cpu": Hardware(
        name="cpu", gpu_memory_bytes=16 * GiB, matmul_flops_per_s=50e9, block_efficiency=0.5,
        h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, duplex_bytes_per_s=5e9,
        host_dram_bytes_per_s=10e9, cpu_adamw_params_per_s=0.3e9, cpu_adamw_contended_fraction=1.0,
        cpu_cores=2, gpu_p2p_bytes_per_s=0.0,
    ),
}


# Coefficients of a preset that only whole steps (or kernels inside them) fit, which no micro-benchmark of
# `slidedp calibrate` gives: the host's time to issue a block, the fused head's rate, and a compiled block's
# rate inside a step (calibrate times one alone, on an idle card). The CPU AdamW's shares beside copies (in
# place, and out of place as early updates write) are calibrate's own: it keeps the copies running for as
# long as it times the AdamW (an H100 host: 0.70, where a step's round of updates runs at 0.66 and the
# H200's step fit says 0.78; benchmarks/cpu_adamw/README.md).
STEP_FITTED = ("host_block_fwd_s", "host_block_bwd_s", "head_efficiency", "compiled_block_efficiency")


def step_fits_suffix(reference: str) -> str:
    """What with_step_fits appends to a profile's name (before the compiled blocks' scaling, if any)."""
    return f" + {reference} step fits"


def with_step_fits(profile: Hardware, reference: str = "h200-sxm", *, block_ratio: float = 1.0,
                   block: str | None = None) -> Hardware:
    """`profile` (a machine's `slidedp calibrate` measurements) with the STEP_FITTED coefficients of the
    preset `reference`, fitted on that preset's measured steps (of a Qwen3-4B block); its name says so.
    `block_ratio`: the rate of the planned model's compiled block over the fitted block's, both timed on
    this machine (profiler.calibrate.block_rate_ratio): the compiled_block_efficiency is the fitted one
    times it, and the name says so, with `block` (the model's name)."""
    if reference not in PRESETS:
        raise ValueError(f"unknown preset {reference!r} for the step fits; known: {', '.join(sorted(PRESETS))}")
    if not (math.isfinite(block_ratio) and block_ratio > 0):
        raise ValueError(f"block_ratio must be a positive number, got {block_ratio!r}")
    ref = PRESETS[reference]
    fits = {field: getattr(ref, field) for field in STEP_FITTED}
    name = profile.name + step_fits_suffix(reference)
    fits["compiled_block_efficiency"] = ref.compiled_block_efficiency * block_ratio
    if block is not None or block_ratio != 1.0:
        name += f", compiled blocks x{block_ratio:.3f}" + (f" ({block})" if block else "")
    return replace(profile, name=name, **fits)


# The fields of a profile that belong to the host, not the GPU: its DRAM, its CPU AdamW (alone, beside
# the copies, out of place), the copies' share beside it, its cores and the engine's time to issue a
# compiled block. Hosts of one GPU model differ here: three H100 hosts' calibrations measured 3.9, 4.4 and
# 4.9 G params/s of CPU AdamW (benchmarks/predict_vs_measured/results/*-h100-*calibrated-profile.json).
HOST_FIELDS = ("host_dram_bytes_per_s", "cpu_adamw_params_per_s", "cpu_adamw_params_per_s_by_threads",
               "cpu_adamw_contended_fraction", "cpu_adamw_backward_fraction", "duplex_contended_fraction",
               "cpu_cores", "host_compiled_fwd_s", "host_compiled_bwd_s")
HOST_SUFFIX = ", host re-measured"


def with_host(profile: Hardware, host: Hardware) -> Hardware:
    """`profile` with the HOST_FIELDS of `host` (a `slidedp calibrate --host-only` profile of the host that
    runs); its name says so."""
    name = profile.name if profile.name.endswith(HOST_SUFFIX) else profile.name + HOST_SUFFIX
    return replace(profile, name=name, **{field: getattr(host, field) for field in HOST_FIELDS})


# Links between hosts: each host's aggregate rate into the network [bytes/s], at the share of the line
# rate that NCCL's rings reach on such fabrics (LINK_EFFICIENCY; a nominal figure, not measured here).
LINK_EFFICIENCY = 0.85
LINKS: dict[str, float] = {
    "ib-8x400": 8 * 400e9 / 8 * LINK_EFFICIENCY,  # eight 400 Gb/s InfiniBand NICs (one per GPU)
    "ib-4x400": 4 * 400e9 / 8 * LINK_EFFICIENCY,
    "ib-1x400": 400e9 / 8 * LINK_EFFICIENCY,
    "eth-2x100": 2 * 100e9 / 8 * LINK_EFFICIENCY,  # two 100 GbE ports (RoCE)
    "eth-1x100": 100e9 / 8 * LINK_EFFICIENCY,
    "eth-1x25": 25e9 / 8 * LINK_EFFICIENCY,
}


def resolve_link(link: "str | float | int | None") -> float:
    """A host's rate into the network [bytes/s] from a LINKS preset name or a number of bytes/s;
    ValueError naming the presets otherwise."""
    if isinstance(link, str) and link in LINKS:
        return LINKS[link]
    if isinstance(link, (int, float)) and not isinstance(link, bool) and math.isfinite(link) and link > 0:
        return float(link)
    raise ValueError(f"link must be one of {', '.join(LINKS)} or a rate in bytes/s > 0, got {link!r}")


def load_link(path: "str | Path") -> float:
    """The link rate [bytes/s] of a `slidedp calibrate --link` JSON."""
    try:
        data = json.loads(Path(path).read_text())
        rate = float(data["link_bytes_per_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a link measurement of slidedp calibrate --link ({type(e).__name__}: {e})") from None
    if not rate > 0:
        raise ValueError(f"{path}: link_bytes_per_s must be > 0, got {rate}")
    return rate


def resolve_hardware(hardware: "Hardware | str | None", device: str) -> Hardware:
    """A Hardware from a preset name, a profile path, a Hardware, or a guess from the device."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware is None:
        if device == "cuda":
            import torch  # torch.cuda only here: picking a preset by the present GPU's name

            name = torch.cuda.get_device_name().lower()
            props = torch.cuda.get_device_properties(0)
            for key, preset in (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100", "a100-sxm"), ("4090", "rtx4090")):
                if key in name:
                    return replace(PRESETS[preset], gpu_memory_bytes=int(props.total_memory))
            warn_once(("hardware", name),
                      "unknown GPU %r: the step-time model uses the h100-sxm preset's figures (with this GPU's "
                      "memory); measure this machine with `slidedp calibrate --out hw.json`, then pass "
                      "hardware=\"hw.json\" (--hardware hw.json)", name)
            return replace(PRESETS["h100-sxm"], name=name, gpu_memory_bytes=int(props.total_memory))
        warn_once(("hardware", "cpu"),
                  "no GPU: the step-time model uses the 'cpu' preset, nominal figures for tests and CI, not "
                  "measured on this machine; measure it with `slidedp calibrate --out hw.json`, then pass "
                  "hardware=\"hw.json\" (--hardware hw.json)")
        return PRESETS["cpu"]
    if isinstance(hardware, str):
        if hardware in PRESETS:
            return PRESETS[hardware]
        if Path(hardware).is_file():
            return Hardware.load(hardware)
        raise ValueError(f"unknown hardware {hardware!r}: a preset ({', '.join(PRESETS)}) or a profile JSON path")
    raise TypeError(f"hardware must be None, a preset name, a path or a slidedp.Hardware, got {type(hardware).__name__}")
