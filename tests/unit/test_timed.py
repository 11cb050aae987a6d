"""A phase's time (``timing_s/*``) holds the device work the phase queued: on a GPU the host leaves a block
before its kernels have run, so ``timed`` waits for the device at both ends."""

import time

from rlctl.metrics import timed


def test_a_phase_time_holds_the_work_the_device_still_had_queued_at_its_end():
    waits = []

    def synchronize() -> None:  # a device that ends the block's queued work 0.2 s after the host left it
        waits.append(time.perf_counter())
        if len(waits) == 2:
            time.sleep(0.2)

    t: dict[str, float] = {}
    with timed(t, "update_actor", synchronize):
        pass
    assert len(waits) == 2 and t["timing_s/update_actor"] >= 0.2
    with timed(t, "gen"):  # (the CPU: nothing to wait for)
        pass
    assert 0 <= t["timing_s/gen"] < 0.2
