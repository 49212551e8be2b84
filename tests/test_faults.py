"""Faults: a failure inside device work, an interrupt mid-run, a KV cache too small for everyone at once,
a device that stops answering, a device process that dies.

Each ends with an exception (or the right tokens), no worker thread left behind, and a next call that
gives the same tokens as an undisturbed run.
"""

import sys
import threading

import pytest
import torch

import minibatch
from minibatch.devices import DeviceError

KW = dict(max_new_tokens=6, max_batch_tokens=16, max_batch_size=4)


@pytest.fixture(scope="module")
def work():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 12, 3, 9, 7, 4)]


def workers():
    return [t for t in threading.enumerate() if t.name.startswith("minibatch-")]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failure_inside_device_work_surfaces_and_the_next_call_works(random_llama, work, mode, monkeypatch):
    ref = minibatch.generate(random_llama, work, mode=mode, **KW)
    calls = {"n": 0}
    real_next_tokens = type(random_llama).next_tokens

    def failing_step(self, batch, cache, compiled=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return real_next_tokens(self, batch, cache)

    monkeypatch.setattr(type(random_llama), "next_tokens", failing_step)
    with pytest.raises(DeviceError, match="injected device failure"):
        minibatch.generate(random_llama, work, mode=mode, timeout=30, **KW)
    monkeypatch.undo()
    assert not workers()
    assert minibatch.generate(random_llama, work, mode=mode, **KW) == ref


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_interrupt_mid_run_leaves_nothing_behind(random_llama, work, mode):
    ref = minibatch.generate(random_llama, work, mode=mode, **KW)
    interval = sys.getswitchinterval()

    def interrupt(plan, done):
        if plan.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        minibatch.generate(random_llama, work, mode=mode, on_step=interrupt, **KW)
    assert not workers()
    assert sys.getswitchinterval() == interval
    assert minibatch.generate(random_llama, work, mode=mode, **KW) == ref


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_more_requests_than_the_cache_holds_wait_their_turn(random_llama, work, mode):
    ref = minibatch.generate(random_llama, work, mode="sync", **KW)
    # 18 tokens at most per request = 5 blocks of 4: room for one request at a time, plus a little
    small = minibatch.generate(random_llama, work, mode=mode, block_size=4, num_blocks=7, **KW)
    assert small == ref


def test_a_device_that_stops_answering_times_out(random_llama, work):
    with pytest.raises(DeviceError, match="timed out"):
        minibatch.generate(random_llama, work, mode="async", inject_delays={"compute": 2.0}, timeout=0.2, **KW)
    assert not workers()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_device_process_that_dies_is_an_error_naming_it_and_the_next_call_works(random_llama, work, mode):
    """The device process killed mid-run (as the out-of-memory killer or a crash in native code would):
    the run ends with a DeviceError that says the process died and how, not a hang and not a bare
    BrokenPipeError; the engine opens a new device for the next call."""
    import os
    import signal

    if torch.cuda.is_initialized():
        pytest.skip("this process has started CUDA: the cpu device runs as threads, there is no process to kill")
    ref = minibatch.generate(random_llama, work, mode=mode, **KW)
    with minibatch.Engine(random_llama) as engine:
        assert engine.generate(work, mode=mode, **KW) == ref
        pid = engine.dev._proc.pid
        killed = {"done": False}
        real_step = engine.step

        def step_then_kill(*args, **kwargs):  # the host side of a step, then the device is gone
            out = real_step(*args, **kwargs)
            if not killed["done"]:
                killed["done"] = True
                os.kill(pid, signal.SIGKILL)
            return out

        engine.step = step_then_kill
        with pytest.raises(DeviceError, match=r"died: killed by signal 9 \(SIGKILL\).*MINIBATCH_CPU_DEVICE"):
            engine.generate(work, mode=mode, timeout=30, **KW)
        del engine.step
        assert engine.generate(work, mode=mode, **KW) == ref
        assert engine.dev._proc.pid != pid
    with pytest.raises(DeviceError, match="died"):  # a bare device: the first launch after the death says so
        from minibatch.devices import get_device

        with get_device("cpu") as dev:
            x = dev.empty((1,), torch.int64)
            os.kill(dev._proc.pid, signal.SIGKILL)
            dev._proc.join(5)
            dev.stream("a").launch(x.add_, 1)
