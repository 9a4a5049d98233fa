"""CompileOptions: the workload and run settings of `slidedp.compile` / `slidedp.plan` as one typed
value (`compile(model, budget, options=CompileOptions(batch_size=4, seq_len=2048))`), beside the
same keyword arguments one by one. `SolverOptions` (slidedp.scheduler.decisions) says what the
solver may choose from; this says what is being planned for."""

from __future__ import annotations

from dataclasses import dataclass, fields

from slidedp.optim import AdamW


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    batch_size: int  # rows per rank per micro-batch
    seq_len: int  # tokens per row
    world_size: int = 1  # data-parallel ranks on this host
    device: str = "auto"  # "auto" | "cuda" | "cpu"
    precision: str = "auto"  # "auto" (bf16 on a GPU, fp32 on the CPU) | "bf16" | "fp32"
    optimizer: AdamW | None = None  # None: AdamW()
    max_grad_norm: float | None = None  # exact global clipping; None: none
    hardware: object = None  # a preset name, a profile path, a Hardware, or None (detected)
    micro_batches: int = 1  # micro-batches per rank sharing one pass over the weights
    compile_blocks: bool | None = None  # torch.compile the blocks; None: on CUDA, as a given plan says
    # a step whose gradient is not finite: "skip" it (nothing changes), or "stop" (NonFiniteGradientError);
    # "stop" with max_grad_norm=None on one rank lets the plan stream gradients into the update
    nonfinite: str = "skip"
    # the plan may group the batch_size x micro_batches rows of a rank's step into micro-batches of
    # another number of rows, the fastest predicted (scheduler/search/micro_rows.py); "auto": where the
    # blocks are host-bound
    group_rows: bool | str = "auto"

    def as_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def merge(options: CompileOptions | None, given: dict) -> dict:
    """The keyword arguments of compile/plan from `options` or from those `given` one by one (the ones
    not left at their defaults), refusing both at once or neither."""
    defaults = {f.name: f.default for f in fields(CompileOptions) if f.name not in ("batch_size", "seq_len")}
    explicit = {k: v for k, v in given.items() if k in ("batch_size", "seq_len") and v is not None
                or k in defaults and v is not defaults[k] and v != defaults[k]}
    if options is None:
        missing = [k for k in ("batch_size", "seq_len") if given.get(k) is None]
        if missing:
            raise TypeError(f"{' and '.join(missing)} must be given (or options=CompileOptions(...))")
        return dict(given)
    if not isinstance(options, CompileOptions):
        raise TypeError(f"options must be a slidedp.CompileOptions, got {type(options).__name__}")
    if explicit:
        raise ValueError(f"give the workload either as options=CompileOptions(...) or as keyword arguments, not "
                         f"both ({', '.join(sorted(explicit))} given beside options)")
    return options.as_kwargs()
