"""The device memory watch (slidedp/run/device_memory.py): a warning once per kind of overrun, where a
step's reserved memory passed the budget or its allocated peak the plan's."""

import logging

from slidedp.run.device_memory import ALLOCATED_SLACK, DeviceMemoryWatch, overruns

GiB = 2**30


def peaks(allocated, reserved):
    return {"max_allocated_bytes": int(allocated), "max_reserved_bytes": int(reserved)}


def test_overruns_within_budget_and_plan_is_silent():
    assert overruns(reserved_bytes=6 * GiB, allocated_bytes=5 * GiB, budget_bytes=6 * GiB,
                    predicted_peak_bytes=5 * GiB) == {}
    # within the slack of the plan's peak
    assert overruns(reserved_bytes=5 * GiB, allocated_bytes=int(5 * GiB * (1 + ALLOCATED_SLACK / 2)),
                    budget_bytes=6 * GiB, predicted_peak_bytes=5 * GiB) == {}


def test_overruns_name_each_kind_and_the_excess():
    found = overruns(reserved_bytes=int(6.5 * GiB), allocated_bytes=int(5.5 * GiB), budget_bytes=6 * GiB,
                     predicted_peak_bytes=5 * GiB)
    assert set(found) == {"reserved", "allocated"}
    assert "512.00 MiB over the budget of 6.00 GiB" in found["reserved"]
    assert "512.00 MiB more than the plan's predicted 5.00 GiB" in found["allocated"]
    # a plan saved without its explanation (peak 0) is not checked against it
    assert set(overruns(reserved_bytes=5 * GiB, allocated_bytes=5 * GiB, budget_bytes=6 * GiB,
                        predicted_peak_bytes=0)) == set()


def test_watch_warns_once_per_kind_and_again_when_the_overrun_doubles(caplog):
    reads = iter([[peaks(4 * GiB, 5 * GiB)], [None, peaks(4 * GiB, 7 * GiB)], [peaks(6 * GiB, 7.5 * GiB)],
                  [peaks(6 * GiB, 7.9 * GiB)], [peaks(6 * GiB, 8 * GiB)]])
    watch = DeviceMemoryWatch(lambda: next(reads), budget_bytes=6 * GiB, predicted_peak_bytes=5 * GiB)
    with caplog.at_level(logging.WARNING, logger="slidedp"):
        watch.after_step(1)
        assert not caplog.records
        watch.after_step(2)  # rank 1 reserved over the budget
        assert len(caplog.records) == 1
        assert "by step 2 (rank 1)" in caplog.records[0].getMessage() and "reserved 7.00 GiB" in caplog.records[0].getMessage()
        watch.after_step(3)  # now allocated over the plan as well: only that one is new
        assert len(caplog.records) == 2 and "6.00 GiB allocated at the peak" in caplog.records[1].getMessage()
        watch.after_step(4)  # the reserve grew, but by less than twice its excess (1.9 GiB against 1)
        assert len(caplog.records) == 2
        watch.after_step(5)  # twice the excess told: told again, with the new figure
        assert len(caplog.records) == 3
        message = caplog.records[2].getMessage()
        assert "by step 5 (rank 0), grown since last told" in message and "reserved 8.00 GiB" in message


def test_watch_of_worker_ranks_reads_after_steps_one_two_four_eight():
    read_at = []
    watch = DeviceMemoryWatch(lambda: read_at.append(watch.steps) or [peaks(1, 1)], budget_bytes=GiB,
                              predicted_peak_bytes=GiB, every_step=False)
    for step in range(100, 110):  # resumed: the optimizer's count is not the watch's
        watch.after_step(step)
    assert read_at == [1, 2, 4, 8]


def test_engine_reads_the_watch_after_each_step(caplog):
    """On the CPU there are no device peaks (no watch); a watch given to the engine is read after every
    step with the optimizer's step count, and its warning carries the plan's own budget."""
    import torch

    from tests.engine.test_bf16_and_inputs import compile_llama
    from tests.engine.test_exactness import BATCH, random_batch

    engine = compile_llama()
    assert engine._memory is None
    budget = engine.plan.budget_bytes
    engine._memory = DeviceMemoryWatch(lambda: [peaks(1, budget + GiB)], budget_bytes=budget,
                                       predicted_peak_bytes=engine.plan.explanation.peak_device_bytes)
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="slidedp"):
        for _ in range(2):
            engine.step(*random_batch(gen, BATCH))
    engine.close()
    assert engine._memory.steps == 2
    told = [r.getMessage() for r in caplog.records if "device memory" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("slidedp: device memory by step 1 (rank 0): the CUDA caching")
