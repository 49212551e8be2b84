"""The cpu device process lives and dies with its host; a fork of the host never disturbs its parent.

Each case runs a host in a subprocess of its own (killing the test process is not an option), and
looks for the device process by the pid the host reports.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOST = """
import os, sys, time
from minibatch.devices import get_device
dev = get_device("cpu")
dev.synchronize(30)
print(dev._proc.pid, flush=True)
if sys.argv[1] == "_exit":
    os._exit(3)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")
def test_the_device_process_ends_with_its_host_however_the_host_ends():
    hows = ["SIGKILL", "SIGTERM", "_exit"]
    hosts = {how: _python(HOST, how) for how in hows}  # started together: each pays its start-up at once
    left = {}
    try:
        devices = {}
        for how, host in hosts.items():
            line = host.stdout.readline()
            assert line.strip().isdigit(), host.stderr.read()
            devices[how] = int(line)
            if how != "_exit":
                host.send_signal(getattr(signal, how))
        for how, host in hosts.items():
            host.wait(30)
            deadline = time.monotonic() + 2.0
            while _alive(devices[how]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(devices[how]):
                left[how] = devices[how]
    finally:
        for host in hosts.values():
            if host.poll() is None:
                host.kill()
                host.wait()
        for pid in left.values():
            os.kill(pid, signal.SIGKILL)
    assert not left, f"device processes that outlived their host, by how the host ended: {left}"


FORK = """
import os, sys
import minibatch
from minibatch.devices import DeviceError
from minibatch.core.engine import Engine
model = minibatch.load_model("tiny")
engine = Engine(model)
prompts = [[5, 6, 7, 8], [9, 10]]
ref = engine.generate(prompts, max_new_tokens=4, temperature=0.8)
pid = os.fork()
if pid == 0:
    try:
        engine.generate(prompts, max_new_tokens=4)
        print("child: no error", flush=True)
    except DeviceError as e:
        print("child:", e, flush=True)
    print("child fresh:", minibatch.generate(model, prompts, max_new_tokens=4, temperature=0.8) == ref, flush=True)
    sys.exit(0)  # a normal exit: the exit handlers run
os.waitpid(pid, 0)
for _ in range(3):
    print("parent:", engine.generate(prompts, max_new_tokens=4, temperature=0.8) == ref, flush=True)
engine.close()
"""


def test_a_fork_cannot_use_its_parents_device_and_leaves_it_alone():
    proc = _python(FORK)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "child: this device was opened by process" in out and "open a new Engine" in out, out
    assert "child fresh: True" in out, out  # a new engine in the child works
    assert out.count("parent: True") == 3, out + err  # the parent is not disturbed
    assert "can only join a child process" not in err and "Traceback" not in err, err


POOL = """
import multiprocessing, warnings
import minibatch

def work(prompt):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = minibatch.load_model("tiny")
        out = minibatch.generate(model, [prompt], max_new_tokens=3)
    return out, [str(w.message) for w in seen]

if __name__ == "__main__":
    # the parent computes first, so the workers are forks of a process whose torch thread pool exists
    alone = minibatch.generate(minibatch.load_model("tiny"), [[1, 2, 3]], max_new_tokens=3)
    with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:  # a fresh fork per task
        results = pool.map(work, [[1, 2, 3]] * 4, chunksize=1)
    print(all(out == alone for out, _ in results), all(any("daemonic" in s for s in seen) for _, seen in results),
          flush=True)
"""


def test_generate_in_a_pool_worker_falls_back_to_threads():
    proc = _python(POOL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split() == ["True", "True"], out + err
