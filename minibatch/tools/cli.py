"""Command line: `python -m minibatch demo` (the main job), `bench`, `serve` and `bench-serve`.

Options are checked as they are parsed and `--out` is checked for writing before any work, so a
mistake costs no model load and no run; a user error prints one line `error: ...` and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from .cli_args import _GRAPHS, _float, _int, _writable
from .cli_serving import add_serving

DEMO_PROMPTS = [
    "The for statement",
    "A class definition",
    "Exceptions are raised",
    "The import system",
    "Assignment statements",
    "A string literal",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option gives one line (no usage block): `error: argument --x: why`."""

    def error(self, message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _modes(arg: str) -> list[str]:
    from ..core.config import MODES
    modes = [m for m in arg.split(",") if m]
    if not modes:
        raise argparse.ArgumentTypeError("needs at least one of sync, async")
    from .bench import split_mode
    for m in modes:
        if split_mode(m)[0] not in MODES:
            raise argparse.ArgumentTypeError(f"unknown mode {m!r} (choose from {', '.join(MODES)}, each "
                                             "optionally with +compile or +dynamic, e.g. async+compile)")
    return modes


HF_MODES = ("sync_eager", "sync_graphs", "async_eager", "async_graphs")


def _hf_modes(arg: str) -> list[str]:
    """--hf's value: "default" (its default config), "all" (HF_MODES) or some of HF_MODES."""
    if arg in ("default", "all"):
        return [arg] if arg == "default" else list(HF_MODES)
    modes = [m for m in arg.split(",") if m]
    bad = [m for m in modes if m not in HF_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"--hf takes 'default', 'all' or some of {', '.join(HF_MODES)}, got {arg!r}")
    return modes


def demo(args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import bench
    from ..core.engine import Engine
    from ..model.model import load_model

    out = _writable(args.out)
    model = load_model(args.model, device=args.device)
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"the demo prints text, and model {args.model!r} has no tokenizer: use the built-in "
                         "'tiny' model, or `python -m minibatch bench` for token-id workloads")
    print(f"model {model.name!r} on {model.device} ({model.dtype}), {len(DEMO_PROMPTS)} prompts, "
          f"{args.max_new_tokens} new tokens each\n")
    prompts = [tok.encode(p) for p in DEMO_PROMPTS]
    # sampled, seeded: greedy decoding makes a model this small repeat itself
    kw = dict(eos_token_id=tok.eos_token_id, max_batch_size=4, max_batch_tokens=32, temperature=args.temperature,
              seed=args.seed)
    with Engine(model) as engine:
        # untimed, each mode once: otherwise the first timed run alone pays for opening the device and the
        # first calls, which flatters whichever mode runs second
        for mode in args.modes:
            bench.run_mode(engine, prompts, mode, args.max_new_tokens, **kw)
        results, timelines, outs, ratios = bench.alternating_pairs(engine, prompts, args.modes, args.pairs,
                                                                   args.max_new_tokens, **kw)
    for p, o in zip(DEMO_PROMPTS, outs):
        print(f"  {p!r} -> {tok.decode(o)!r}")
    print()
    print(f"the last pair of {args.pairs}:")
    print(bench.format_table(results))
    if ratios:
        print(f"\nwall time {args.modes[-1]} / {args.modes[0]} over {len(ratios)} alternating pairs: median "
              f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f} "
              "(one pair alone says little: other programs move it)")
    print(f"every pair gave the same tokens in every mode ({len(args.modes)} modes x {args.pairs} pairs)")
    fig = _demo_figure(results, timelines)
    fig.savefig(out / "demo_timeline.png", dpi=110)
    _chrome_trace(results, timelines, out / "demo_trace.json")
    print(f"\nwrote {out / 'demo_timeline.png'} (timelines: the whole runs, and ten steps of each) and "
          f"{out / 'demo_trace.json'} (every run; open in ui.perfetto.dev)")


def _demo_figure(results, timelines, zoom_steps: int = 10):
    """Left: every run on one time axis. Right: the same length of time from the middle of each run,
    long enough for `zoom_steps` steps of the slowest one, where the overlap (or its absence) shows."""
    import matplotlib.pyplot as plt

    walls = [max(s.end for s in tl.spans) for tl in timelines]
    mids = []
    for tl in timelines:
        starts = sorted({s.step: s.start for s in sorted(tl.spans, key=lambda s: -s.start)
                         if s.lane == "CPU" and s.name == "prepare"}.items())
        mids.append(starts[len(starts) // 2][1] if starts else 0.0)
    periods = [tl_wall / max(r.steps, 1) for tl_wall, r in zip(walls, results)]
    window = zoom_steps * max(periods)
    fig, axes = plt.subplots(len(timelines), 2, figsize=(15, 2.6 * len(timelines)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for row, (r, tl, mid) in enumerate(zip(results, timelines, mids)):
        tl.plot(ax=axes[row, 0], start=0.0, end=max(walls),
                title=f"{r.mode}: {r.wall_s:.2f} s, device busy {r.device_busy:.0%}, {r.tokens_per_s:.0f} tok/s")
        axes[row, 0].axvspan(mid, mid + window, color="#000000", alpha=0.08)  # the zoomed window
        tl.plot(ax=axes[row, 1], start=mid, end=mid + window,
                title=f"{r.mode}: {1e3 * window:.0f} ms from mid-run (shaded on the left)")
        axes[row, 1].get_legend().remove()
    fig.tight_layout()
    return fig


def _chrome_trace(results, timelines, path) -> None:
    """Every run in one Chrome trace: a process per run, a thread per lane."""
    import json
    import tempfile

    events = []
    for pid, (r, tl) in enumerate(zip(results, timelines)):
        with tempfile.TemporaryDirectory() as tmp:
            tl.to_chrome_trace(Path(tmp) / "t.json")
            one = json.loads((Path(tmp) / "t.json").read_text())["traceEvents"]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": r.mode}})
        events += [{**e, "pid": pid} for e in one]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def bench_cmd(args) -> None:
    from . import bench
    from . import floors
    from ..core.device import platform
    from ..core.engine import Engine
    from ..model.model import load_model

    if args.out:
        _writable(args.out)
    model = load_model(args.model, device=args.device)
    if args.decode_attention != "auto":
        if args.decode_attention == "triton":
            from ..model import triton_decode
            if not triton_decode.available():
                raise ValueError("--decode-attention triton needs the triton package (CUDA builds of PyTorch bring it)")
        model.decode_attention = args.decode_attention
    prompts = bench.random_prompts(args.num_prompts, args.prompt_len, model.vocab_size, args.seed)
    workload = dict(num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                    max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                    cuda_graphs=args.cuda_graphs, decode_attention=model.decode_attention,
                    decode_kv_bucket=model.decode_kv_bucket, prefix_caching=args.prefix_caching)
    kw = dict(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens, progress=not args.no_progress,
              cuda_graphs=_GRAPHS[args.cuda_graphs], prefix_caching=args.prefix_caching == "on")
    if args.arrivals:  # prompt i reaches the server at step i * arrivals / n: prefill steps all along the run
        kw["arrival_steps"] = [i * args.arrivals // len(prompts) for i in range(len(prompts))]
        workload["arrivals"] = args.arrivals
    compiled = {m: bench.split_mode(m)[1] for m in args.modes}
    if any(compiled.values()) and not platform(model.device).compiles:
        raise ValueError("+compile and +dynamic modes need a CUDA model (decode steps through torch.compile)")
    engine = Engine(model)  # one engine for every mode: CUDA graphs are captured once, in the warm-up
    if args.warmup:  # untimed: first launches, cuDNN plans, compiles and (graphs on) the CUDA graph captures
        for mode in args.modes:
            # full workload where shapes get captured or compiled, so none is left for the timed run
            full = platform(model.device).graphs and (args.cuda_graphs != "off" or bool(compiled[mode]))
            few = {k: v[:4] if k == "arrival_steps" else v for k, v in kw.items()}
            bench.run_mode(engine, prompts if full else prompts[:4], mode, args.max_new_tokens if full else 4,
                           **{**(kw if full else few), "progress": False})
    results, outs = [], {}
    for mode in args.modes:
        r, tl, o = bench.run_mode(engine, prompts, mode, args.max_new_tokens, **kw)
        results.append(r)
        outs[mode] = o
        if args.out:
            tl.save(Path(args.out) / f"timeline_{mode.replace('+', '-')}.json")  # no "+" in file names
    engine.close()  # frees the device for transformers' runs below
    if args.hf:
        _hf_runs(args, model, prompts, results, outs)
    print(json.dumps(bench.environment(model)))
    print(bench.format_table(results))
    if len(outs) > 1:
        first = args.modes[0]
        for mode, o in outs.items():  # against the first mode of the same compile: same kernels, same rounding
            ref = next((m for m in args.modes if compiled[m] == compiled.get(mode, False)), first)
            same = sum(a == b for a, b in zip(o, outs[ref]))
            print(bench.agreement_line(mode, ref, same, len(o), model.dtype))
    print(bench.summary(results))
    if args.floor:
        print("\n".join(floors.floor_report(model, workload, results)))
    if args.out:
        bench.save_json(Path(args.out) / "bench.json", model, results, workload)


def _hf_runs(args, model, prompts, results: list, outs: dict) -> None:
    """transformers' continuous batching, each of --hf's modes in a process of its own
    (bench.hf_in_own_process): its results and tokens join ours."""
    from . import bench
    from ..core.device import platform

    configs = [dict()]
    if args.hf != ["default"]:
        graphs = (False, True) if platform(model.device).graphs else (False,)  # graphs need a GPU
        configs = [dict(use_async=a, use_graphs=g, memory=args.hf_memory) for a in (False, True) for g in graphs
                   if f"{'async' if a else 'sync'}_{'graphs' if g else 'eager'}" in args.hf]
    for c in configs:
        try:
            r, o = bench.hf_in_own_process(args.model, str(model.device), prompts, args.max_new_tokens, c,
                                           warmup=args.warmup)
        except Exception as e:  # noqa: BLE001 - one failing HF mode must not lose the others' numbers
            print(f"transformers generate_batch {c} failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        results.append(r)
        outs[r.mode] = o


def main(argv=None) -> None:
    p = _Parser(prog="python -m minibatch", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the tiny model continues a few prompts; table + timeline figure")
    d.add_argument("--model", default="tiny")
    d.add_argument("--device", default="auto", help="auto, cpu or cuda")
    d.add_argument("--modes", type=_modes, default=["sync", "async"], help="comma-separated: sync,async")
    d.add_argument("--max-new-tokens", type=_int(1), default=48)
    d.add_argument("--temperature", type=_float(0.0), default=0.7)
    d.add_argument("--seed", type=_int(0), default=0)
    d.add_argument("--pairs", type=_int(1), default=5, help="alternating runs of the modes, for a median and a range")
    d.add_argument("--out", default=os.environ.get("MINIBATCH_OUT", "out"), help="folder for figure and trace")
    d.set_defaults(func=demo)
    _add_bench(sub)
    add_serving(sub)
    args = p.parse_args(argv)
    if args.cmd == "bench" and args.hf_memory is not None and args.hf in (None, ["default"]):  # else silently unused
        p.error("--hf-memory sizes the KV cache of transformers' chosen modes: it needs --hf MODES (e.g. --hf all)")
    from ..devices import DeviceError

    try:
        args.func(args)
    except DeviceError:  # a fault or timeout inside device work is no user error: keep its traceback
        raise
    except (ValueError, TypeError, OSError) as e:  # user errors (bad model folder, device, sizes): one line
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        raise SystemExit(2) from None


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="one workload, each mode, side by side; JSON out")
    b.add_argument("--model", default="tiny")
    b.add_argument("--device", default="auto")
    b.add_argument("--modes", type=_modes, default=["sync"],
                   help="comma-separated: sync, async, each optionally +compile (decode steps through torch.compile, "
                        "once per batch size) or +dynamic (once for every batch size); compile: CUDA only")
    b.add_argument("--num-prompts", type=_int(1), default=32)
    b.add_argument("--prompt-len", type=_int(1), default=64)
    b.add_argument("--max-new-tokens", type=_int(1), default=64)
    b.add_argument("--max-batch-size", type=_int(1), default=32)
    b.add_argument("--max-batch-tokens", type=_int(1), default=512)
    b.add_argument("--seed", type=_int(0), default=0)
    b.add_argument("--arrivals", type=_int(0), default=0, metavar="STEPS",
                   help="requests arrive spread over the first STEPS steps instead of all at once")
    b.add_argument("--warmup", action="store_true",
                   help="an untimed run of each mode first (and of each transformers mode, with --hf)")
    b.add_argument("--cuda-graphs", choices=list(_GRAPHS), default="auto",
                   help="replay steps as CUDA graphs (auto: on for CUDA; decode: decode steps only)")
    b.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                   help="prompts that start alike share the KV blocks of that start (random prompts rarely do)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--hf", type=_hf_modes, nargs="?", const=["default"], default=None, metavar="MODES",
                   help="also run transformers' generate_batch, each mode in a process of its own: --hf (its "
                        "default config), --hf all (sync/async x eager/graphs) or some of sync_eager, "
                        "sync_graphs, async_eager, async_graphs, comma-separated")
    b.add_argument("--hf-memory", type=_float(0.0, 1.0, low_open=True), default=None,
                   help="with --hf MODES: fraction of GPU memory for its KV cache (default: its own, which "
                        "can leave its async modes short of memory on a large model)")
    b.add_argument("--floor", action="store_true",
                   help="also measure the floor of a decode step (every weight and key/value byte it reads, at "
                        "the measured copy bandwidth) and of a prefill (its FLOPs at the measured matmul rate)")
    b.add_argument("--decode-attention", choices=["auto", "sdpa", "einsum", "triton"], default="auto",
                   help="decode-step attention (attention.py; auto: triton on CUDA where Triton is installed, else "
                        "sdpa; einsum on the CPU; triton: triton_decode.py, reads the KV cache in place). "
                        "Decode-layout steps only: CUDA")
    b.add_argument("--out", default=None, help="folder for bench.json and timelines")
    b.set_defaults(func=bench_cmd)

