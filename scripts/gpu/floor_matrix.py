"""The decode step against its full floor, at fixed batch sizes and context lengths (GPU only).

    python3 scripts/gpu/floor_matrix.py OUTDIR [--model llama3-8b-shape] [--batches 1,8,32,128]
                                               [--contexts 512,2048] [--compile [--unmerged] [--skinny-ab]]
                                               [--variants LABEL:NAME=VALUE ...] [--kernels [top|all]]

Why not read the step off a generate run: there the batch changes as requests arrive and finish, and
at large batch x context most steps are prefill. Here every point is one decode step at exactly
`batch` rows of `context` tokens each:

* a paged KV cache holds `batch` requests of `context` tokens, filled with random values (a step's
  time does not depend on them; nothing is prefilled, which at 128 x 2048 tokens would take longer
  than the whole measurement);
* the step's batch is built and run by the engine's own StepRunner, IO slot and CUDA graph (what
  `generate` does for a decode step), greedy sampling;
* the graph is replayed `--replays` times between two CUDA events: mean milliseconds per step;
* floor: `floors.decode_floor_ms`, the weights plus every row's keys and values at the copy bandwidth
  measured in the same process; beside it "linear": every Linear layer of the model once at that
  batch, in one CUDA graph (`floors.weight_floor_ms`), what the matrix products alone take.

Paths: "default" is the engine's step as `generate` runs it (Triton decode attention where Triton is
installed); with --compile also "compile", the step through step.CompiledStep (torch.compile, static
shapes; coarser key buckets; Inductor's combined kernels, compiled.COMBO), with the seconds its first
call took (compilation) beside it, and with --skinny-ab also "cublas", the same with every product on cuBLAS (the default compiled step runs
products of 1-4 rows by a narrow weight on speed/skinny.py's kernel), and with --unmerged also
"unmerged", the same as "cublas" without one product for sibling projections (siblings.py), and with
--variants a path per label, the compiled step with those Inductor config changes (CompiledStep's
`inductor`); with early=0 our own kernels (skinny.py's, the decode attention's) launched without
programmatic dependent launch (their default where the GPU has it), with widest=... another rule for
skinny.py's kernel, with argmax=0
the vocabulary's argmax as one reduction (speed/wide_argmax.py: two steps by default), with lean=0 the
decode attention with Triton's default warps and stages at every batch (triton_decode.LEAN), with
one_piece=0 skinny.py's kernel reading K = 2048 in pieces of 1024 (skinny.ONE_PIECE, on by default), with
defer=0 its products of 2-4 rows by K over 2048 summed once a piece (skinny.DEFER, on by default), with carry=1 the step's
carry-over as one compiled kernel (compiled.CARRY_OVER), with fresh=1 q/k/v handed to the decode kernel
as their projections left them (model/fresh.py: fresh.ENABLED; the default for small models, whose steps
fresh=0 takes off it: fresh.IN_SMALL_COMPILES; with apart=0 too, the new key folded in by
the first split's program instead of one of its own: triton_decode.NEW_KEY_APART), with
gated=0 the gate/up product on cuBLAS and silu(gate) * up a kernel of its own (speed/gated.py: on by default at 1-8 rows; gated_rows=0 at one row only),
with short_k=0 the products of K up to 1024 past skinny.WIDEST (the 0.6B merged q/k/v) on cuBLAS (skinny.SHORT_K), and
with skinny_timed=1 the settings of --skinny-settings (skinny_gemv_ab.py's best per product and row count)
taking their products to skinny.py's kernel (skinny.TIMED).
With --kernels, each point's graph is also replayed under torch.profiler and its kernels are summed
by kind: matrix products (cuBLAS/CUTLASS), the decode attention (the Triton kernel and its combine
step, or SDPA's), and everything else; "gaps" is the step's time not covered by any kernel. This says
where a step's time above its floor goes.
Writes OUTDIR/floor_matrix.json after every point, and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import minibatch  # noqa: E402
from minibatch.tools import bench
from minibatch.tools import floors  # noqa: E402
from minibatch.devices import get_device  # noqa: E402
from minibatch.core.requests import Request, SamplingParams  # noqa: E402
from minibatch.core.scheduler import Scheduler  # noqa: E402
from minibatch.core.slots import IOSlot, copy_in  # noqa: E402
from minibatch.speed.compiled import CompiledStep  # noqa: E402
from minibatch.model import fresh, triton_decode  # noqa: E402
from minibatch.speed import (compiled as compiled_module, early, fx_edits, gated, siblings, skinny,  # noqa: E402
                             wide_argmax)
from minibatch.core.graphs import StepRunner

BLOCK = 16
KINDS = {"matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "splitk", "_skinny_kernel", "_sum_splits"),
         "attention": ("_decode_kernel", "_combine_kernel", "flash", "attention", "fmha")}


def parse_setting(text: str) -> tuple:
    """"name=value" -> (name, value), the value a bool (1/0/true/false), an int or else the string."""
    name, _, value = text.partition("=")
    low = value.lower()
    if low in ("1", "true", "0", "false"):
        return name, low in ("1", "true")
    return name, int(value) if value.lstrip("-").isdigit() else value


def best_setting(timing: dict) -> dict:
    """skinny_gemv_ab.py's best setting for one product and row count, as a kernel setting (its split of 1 left out:
    the launch's default)."""
    return {k: v for k, v in timing["config"].items() if k != "split"}


#: --skinny-settings' settings {(rows, n, k): setting}, skinny.TIMED in variants with skinny_timed=1 (filled before
#: the variants' paths compile)
SKINNY_TIMED: dict = {}


#: a variant's on/off names for module settings (parse_variant), and the (module, attribute) each sets
SWITCHES = {"early": (early, "ENABLED"), "argmax": (wide_argmax, "ENABLED"),
            "carry": (compiled_module, "CARRY_OVER"), "one_piece": (skinny, "ONE_PIECE"),
            "lean": (triton_decode, "LEAN"), "fresh": (fresh, "ENABLED"),
            "apart": (triton_decode, "NEW_KEY_APART"), "defer": (skinny, "DEFER"), "gated": (gated, "ENABLED"),
            "gated_rows": (gated, "MANY_ROWS"), "outer": (fx_edits, "OUTER"),
            "rotary": (fresh, "ONE_ROTARY")}
#: a variant's numeric names for module settings, and the (module, attribute, type) each sets
NUMBERS = {"short_k": (skinny, "SHORT_K", int), "per_sm": (triton_decode, "PROGRAMS_PER_SM", float),
           "min_split": (triton_decode, "MIN_SPLIT_KEYS", int),
           "min_split_rows": (triton_decode, "MIN_SPLIT_ROWS", int), "persistent": (siblings, "PERSISTENT_ROWS", int)}


def parse_variant(spec: str) -> tuple[str, dict, dict]:
    """"LABEL:NAME=VALUE,..." -> (label, Inductor config, module settings {(module, name): value}): early=0/1
    (our kernels launched early inside compiled steps: early.ENABLED),
    widest=ROWS:COLUMNS/... (skinny.WIDEST), argmax=0/1 (the vocabulary's argmax in two steps:
    wide_argmax.ENABLED), lean=0/1 (the decode attention's 2 warps and 2 stages at 4-64 rows:
    triton_decode.LEAN), one_piece=0/1 (skinny.ONE_PIECE, on by default), defer=0/1 (skinny.DEFER, on by
    default), carry=0/1 (the carry-over as one compiled
    kernel: compiled.CARRY_OVER), fresh=0/1 (norms, rotary embedding and cache write in the decode kernel:
    model/fresh.py's ENABLED; 0 also IN_SMALL_COMPILES, its rule for small models), apart=0/1 (with fresh, the new key folded in by a program of its own, on by
    default: triton_decode.NEW_KEY_APART), gated=0/1 (silu(gate) * up inside skinny.py's gate/up product: gated.ENABLED, on by default; gated_rows=0: at one row only, gated.MANY_ROWS),
    outer=0/1 (a matrix product over one term as a multiply: fx_edits.OUTER, on by default),
    rotary=0/1 (with fresh's path, one cos and sin for every layer's attention call, on by default; 0: a copy
    computed per layer: fresh.ONE_ROTARY),
    per_sm=N (the decode attention's programs per SM when it splits keys: triton_decode.PROGRAMS_PER_SM),
    min_split=N (the fewest keys a split of it walks: triton_decode.MIN_SPLIT_KEYS; 64 is one chunk, the old rule),
    min_split_rows=N (from how many rows that holds: triton_decode.MIN_SPLIT_ROWS),
    persistent=N (reductions of at most N rows as persistent kernels whatever their hint: siblings.PERSISTENT_ROWS,
    8; 0: Inductor's rule),
    attn=KEYSxWARPSxSTAGES (the decode attention's keys per loop step, warps and stages at every batch:
    triton_decode.SETTINGS),
    short_k=N (the widest product of K <= 1024 that goes to skinny.py's kernel at 1-4 rows, 0 for none: skinny.SHORT_K),
    skinny_timed=1 (--skinny-settings' settings as skinny.TIMED), tile=ROWS:N:K/... (those products on skinny.py's
    tensor-core tile, skinny.TILE, as skinny.TIMED); every other name is Inductor config."""
    label, _, changes = spec.partition(":")
    inductor = dict(parse_setting(c) for c in changes.split(",") if c)
    modules = {target: bool(inductor.pop(name)) for name, target in SWITCHES.items() if name in inductor}
    if modules.get((fresh, "ENABLED")) is False:  # (fresh=0: not by the small models' rule either)
        modules[(fresh, "IN_SMALL_COMPILES")] = False
    if "persistent" in inductor:  # (Inductor's graph cache off: its key leaves the rule out, compat.persistent_rows)
        inductor["fx_graph_cache"] = False
    modules.update({(module, attribute): kind(inductor.pop(name))
                    for name, (module, attribute, kind) in NUMBERS.items() if name in inductor})
    if "attn" in inductor:
        modules[(triton_decode, "SETTINGS")] = tuple(int(v) for v in str(inductor.pop("attn")).split("x"))
    if inductor.pop("skinny_timed", False):
        modules[(skinny, "TIMED")] = SKINNY_TIMED
    if "tile" in inductor:  # (products by rows:n:k on skinny.py's tensor-core tile, whatever its rule says)
        modules[(skinny, "TIMED")] = {tuple(map(int, p.split(":"))): dict(skinny.TILE)
                                      for p in str(inductor.pop("tile")).split("/")}
    if "widest" in inductor:
        modules[(skinny, "WIDEST")] = dict(map(int, p.split(":")) for p in str(inductor.pop("widest")).split("/"))
    return label, inductor, modules


@contextlib.contextmanager
def module_settings(changed: dict):
    """Module attributes set to these values ({(module, name): value}) while open, restored after."""
    saved = {key: getattr(*key) for key in changed}
    for (module, attr), value in changed.items():
        setattr(module, attr, value)
    try:
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)


def kernel_breakdown(replay, reps: int = 5) -> dict:
    """Milliseconds per step of each kind of kernel (KINDS, "other"), and kernels per step."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    out = {"matmul": 0.0, "attention": 0.0, "other": 0.0, "kernels": 0}
    by_name: dict[str, float] = {}
    calls: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or "memcpy" in e.name.lower() or "memset" in e.name.lower():
            continue
        name = e.name.lower()
        kind = next((k for k, pats in KINDS.items() if any(p in name for p in pats)), "other")
        ms = (e.time_range.end - e.time_range.start) / 1e3 / reps
        out[kind] += ms
        out["kernels"] += 1 / reps
        key = f"{kind}: {e.name[:90]}"
        by_name[key] = by_name.get(key, 0.0) + ms
        calls[key] = calls.get(key, 0) + 1 / reps
    # the kernels that take the most: (name, ms per step, calls per step)
    out["top"] = sorted(((k, ms, calls[k]) for k, ms in by_name.items()), key=lambda t: -t[1])
    return out


def decode_point(model, dev, batch: int, context: int, compiled: CompiledStep | None, replays: int,
                 kernels: bool = False, verbose: str | None = None) -> dict:
    """Mean ms of one graphed decode step at `batch` rows x `context` tokens (+ the new one)."""
    cache = model.make_cache(batch * (-(-(context + 2) // BLOCK) + 1) + 8, BLOCK)
    for layer in range(model.num_layers):  # stand-in contents: the time does not depend on them
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
    sched = Scheduler(cache.allocator, batch * context, batch)
    for i in range(batch):
        sched.add(Request(i, [1] * context, SamplingParams(max_new_tokens=4)))
    prefill = sched.schedule()
    assert len(prefill.chunks) == batch and all(c.num_tokens == context for c in prefill.chunks)
    sched.update(prefill, [2] * batch)  # as if prefilled: the cache's cells are allocated and counted
    plan = sched.schedule()
    assert all(c.num_tokens == 1 for c in plan.chunks) and len(plan.chunks) == batch
    runner = StepRunner(model, cache, use_graphs=True, compiled=compiled)
    host = runner.build(plan)
    slot = IOSlot(dev, 0, host.input_ids.shape[0], host.kv_indices.shape[0], host.input_ids.shape[0])
    slot.load(host, [])
    copy_in(slot.buffers, slot.used())
    args = slot.bind(None)
    t = time.perf_counter()
    runner(args)  # eager warm-up (and compilation), capture, one replay
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    graph = runner.graphs[args.key]
    ms = floors.replay_ms(graph.replay, replays)
    keys = host.kv_indices.shape[0] // host.decode_rows
    parts = kernel_breakdown(graph.replay) if kernels else None
    if parts:
        parts["gaps"] = ms - parts["matmul"] - parts["attention"] - parts["other"]
        if verbose:
            for name, kms, n in parts["top"][:None if verbose == "all" else 12]:
                print(f"{'':18} {kms:6.3f} ms {n:5.0f} calls  {name}", flush=True)
    del runner, graph, args, slot, cache
    torch.cuda.empty_cache()
    return {"ms": ms, "first_call_s": first_s, "rows_padded": host.decode_rows, "keys_per_row": keys,
            "kernels": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for floor_matrix.json")
    ap.add_argument("--model", default="llama3-8b-shape")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--compile", action="store_true", help="also time the torch.compile'd step")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode for --compile (e.g. max-autotune-no-cudagraphs: Inductor times "
                         "its own matrix-product kernels against cuBLAS for each shape; much longer compiles)")
    ap.add_argument("--unmerged", action="store_true",
                    help="with --compile, also time the compiled step without merging sibling projections "
                         "(siblings.py): the two side by side")
    ap.add_argument("--skinny-ab", action="store_true",
                    help="with --compile, also time the compiled step with every product on cuBLAS (\"cublas\"), "
                         "beside the default one, whose products of 1-4 rows by a narrow weight run on "
                         "speed/skinny.py's kernel")
    ap.add_argument("--variants", nargs="+", default=[], metavar="LABEL:NAME=VALUE[,NAME=VALUE...]",
                    help="with --compile, also time the compiled step with Inductor config changes, one path per "
                         "LABEL (e.g. late:triton.enable_pdl=0,early=0 combo:combo_kernels=1); early=0 launches our "
                         "own kernels without programmatic dependent launch (speed/early.py); widest=1:8192/8:4096 "
                         "sets skinny.WIDEST (which products go to speed/skinny.py's kernel); argmax=0 "
                         "keeps the vocabulary's argmax one reduction (speed/wide_argmax.py); lean=0 launches the "
                         "decode attention with Triton's default warps and stages (triton_decode.LEAN); one_piece=0 clears "
                         "skinny.ONE_PIECE and defer=0 skinny.DEFER (both on by default); carry=1 sets compiled.CARRY_OVER; fresh=1 sets model/fresh.py's "
                         "ENABLED; apart=0 clears triton_decode.NEW_KEY_APART (on by default); per_sm=0.25 sets triton_decode.PROGRAMS_PER_SM; "
                         "min_split=64 triton_decode.MIN_SPLIT_KEYS (min_split_rows=1 MIN_SPLIT_ROWS); persistent=8 "
                         "siblings.PERSISTENT_ROWS; "
                         "attn=128x4x2 launches the decode attention with 128 keys a loop step, 4 warps, 2 stages "
                         "(triton_decode.SETTINGS); tile=8:1024:3072 runs the 8-row products of 1024 x 3072 on "
                         "skinny.py's tensor-core tile (skinny.TILE, as skinny.TIMED)")
    ap.add_argument("--gated-settings", default=None, metavar="JSON",
                    help="skinny_gemv_ab.py --grid gated's output: its best setting per row count becomes gated.py's "
                         "(gated.TIMED) for every path of this run")
    ap.add_argument("--skinny-settings", default=None, metavar="JSON",
                    help="skinny_gemv_ab.py's output: its best setting per product and row count becomes skinny.py's "
                         "(skinny.TIMED, which routes those products to the kernel) in the paths of variants with "
                         "skinny_timed=1")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--kernels", nargs="?", const="sum", choices=["sum", "top", "all"],
                    help="also sum each step's kernels by kind under torch.profiler (matmul, attention, other, "
                         "gaps); 'top': and print the twelve kernels that take the most time; 'all': every kernel")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("floor_matrix.py measures CUDA graph replays: it needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.gated_settings:
        timed = json.loads(Path(args.gated_settings).read_text())["shapes"]["gate_up"]
        gated.TIMED.update({int(m): best_setting(t) for m, t in timed.items() if m.isdigit()})
        print("gated.py's settings:", gated.TIMED, flush=True)
    if args.skinny_settings:
        shapes = json.loads(Path(args.skinny_settings).read_text())["shapes"]
        SKINNY_TIMED.update({(int(m), sh["N"], sh["K"]): best_setting(t)
                             for sh in shapes.values() for m, t in sh.items() if m.isdigit()})
        print("skinny.py's settings with skinny_timed=1:", SKINNY_TIMED, flush=True)
    model = minibatch.load_model(args.model, device="cuda")
    bandwidth = floors.measure_bandwidth(model.device)
    env = {**bench.environment(model), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
           "command": "python3 scripts/gpu/floor_matrix.py " + " ".join(sys.argv[1:]), "compile_mode": args.compile_mode,
           "memory_bandwidth_gbs": bandwidth / 1e9, "decode_attention": model.decode_attention,
           "gated_settings": {str(m): c for m, c in gated.TIMED.items()},
           "skinny_settings": {"x".join(map(str, key)): c for key, c in SKINNY_TIMED.items()}}
    print(f"{model.name} {model.dtype}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, decode attention {model.decode_attention}", flush=True)
    paths = {"default": None}
    modules = {}  # per path: module settings while it compiles and captures ((module, name): value)
    if args.compile:
        paths["compile"] = CompiledStep(model, args.compile_mode)
        if args.unmerged:
            # (every product on cuBLAS: against "cublas", the merge alone)
            paths["unmerged"] = CompiledStep(model, args.compile_mode, merge=False, skinny=False)
        if args.skinny_ab:
            paths["cublas"] = CompiledStep(model, args.compile_mode, skinny=False)
        for spec in args.variants:
            label, inductor, modules[label] = parse_variant(spec)
            paths[label] = CompiledStep(model, args.compile_mode, inductor=inductor)
            if modules[label].get((fresh, "ENABLED")):
                fresh.install(model.hf)  # (the layers' own forward runs wherever fresh.ENABLED is off)
    points = []
    print(f"{'batch':>5} {'context':>7} {'floor ms':>8} {'linear ms':>9} " + " ".join(f"{p + ' ms':>12} {'x floor':>7}" for p in paths),
          flush=True)
    with get_device("cuda") as dev:
        for batch in batches:
            linear = floors.weight_floor_ms(model, batch)
            for context in contexts:
                floor = floors.decode_floor_ms(model, batch, context + 1, bandwidth)
                kv_floor = floor - floors.decode_floor_ms(model, 0, 0, bandwidth)  # the keys' and values' share
                row = {"batch": batch, "context": context, "floor_ms": floor, "linear_ms": linear, "kv_floor_ms": kv_floor}
                for name, compiled in paths.items():
                    if compiled is not None:
                        torch._dynamo.reset()  # (each path compiles its own graph, even where the backend is shared)
                    with module_settings(modules.get(name, {})):
                        r = decode_point(model, dev, batch, context, compiled, args.replays, args.kernels,
                                         args.kernels if args.kernels in ("top", "all") else None)
                    row[name] = {**r, "over_floor": r["ms"] / floor}
                    if compiled is not None:  # linear calls handed to skinny.py's operator in this point's compile
                        row[name]["routed"] = compiled.routed[-1] if compiled.routed else 0
                        row[name]["argmaxes"] = compiled.argmaxes[-1] if compiled.argmaxes else 0
                points.append(row)
                print(f"{batch:5d} {context:7d} {floor:8.2f} {linear:9.2f} " + " ".join(
                    f"{row[p]['ms']:12.2f} {row[p]['over_floor']:7.2f}" for p in paths)
                    + "".join(f"   ({p}: first call {row[p]['first_call_s']:.1f} s)" for p in paths if p != "default"),
                    flush=True)
                for p in paths:
                    k = row[p]["kernels"]
                    if k:
                        print(f"{'':14} {p}: {k['kernels']:.0f} kernels; matmul {k['matmul']:.2f}, attention "
                              f"{k['attention']:.2f} (keys and values at the floor: {kv_floor:.2f}), other "
                              f"{k['other']:.2f}, gaps {k['gaps']:.2f} ms", flush=True)
                (out / "floor_matrix.json").write_text(json.dumps({"env": env, "points": points}, indent=1))


if __name__ == "__main__":
    main()
