"""Solution to the exercise of notebook 03."""
import torch


def pipeline(dev, host_in, fn):
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    h2d_done, compute_done, d2h_done = dev.event(), dev.event(), dev.event()
    dev_in, dev_out = dev.empty(host_in.shape, host_in.dtype), dev.empty(host_in.shape, host_in.dtype)
    host_out = dev.pin(torch.zeros_like(host_in))
    h2d.copy(dev_in, host_in)
    h2d.record(h2d_done)
    compute.wait(h2d_done)  # the input has landed
    compute.launch(fn, dev_in, dev_out)
    compute.record(compute_done)
    d2h.wait(compute_done)  # the result exists
    d2h.copy(host_out, dev_out, name="D2H", lane="D2H")
    d2h.record(d2h_done)
    d2h_done.synchronize(timeout=10)  # the host waits here, and only here
    return host_out.tolist()
