import pytest
import torch

import minibatch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def random_llama():
    return minibatch.load_model("random-llama", device="cpu")


@pytest.fixture(scope="session")
def tiny():
    return minibatch.load_model("tiny", device="cpu")


@pytest.fixture
def loop_order(monkeypatch):
    """Record the order of the async loop's launches and updates: `record(launch_bound=None, update=True)`
    returns a list that fills with ("launch", step) as each step launches and ("update", step) as the
    loop waits for it and updates (update=False: not recorded). `launch_bound(batch) -> bool`, if given,
    stands in for StepRunner.launch_bound, and each answer is recorded as ("asked", answer)."""
    from minibatch.core import async_loop
    from minibatch.core.graphs import StepRunner

    def record(launch_bound=None, update=True) -> list:
        events = []
        launch, update_with = async_loop.launch_step, async_loop._update
        if launch_bound is not None:
            def bound(self, batch, key):
                events.append(("asked", bool(launch_bound(batch))))
                return events[-1][1]

            monkeypatch.setattr(StepRunner, "launch_bound", bound)

        def recorded_launch(*args):
            events.append(("launch", args[4]))  # (launch_step's fifth argument: the step)
            return launch(*args)

        def recorded_update(run, in_flight):
            events.append(("update", in_flight[0].step))
            return update_with(run, in_flight)

        monkeypatch.setattr(async_loop, "launch_step", recorded_launch)
        if update:
            monkeypatch.setattr(async_loop, "_update", recorded_update)
        return events

    return record
