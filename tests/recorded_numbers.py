"""The numbers the prose quotes, derived from the recorded runs they come from.

Each function reads one recorded run under figures/data and returns the quantities that the
notebooks' prose and the README quote from it. `figures/data/headline.json` holds their values;
tests/test_numbers.py checks that it equals what these functions derive and that every number the
prose marks with `<!-- from figures/data/headline.json: key ... -->` is the headline value rounded
the way it is written.
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "figures" / "data"


def _bench(path: str) -> dict:
    return {r["mode"]: r for r in json.loads((DATA / path).read_text())["results"]}


def decode_step() -> dict:
    """The 8B decode step at batch 32 as it got faster (ms)."""
    text = (DATA / "gpu_step_ab_8b.txt").read_text().splitlines()
    graph = [float(line.split("graph")[1].split()[0]) for line in text if line.startswith("ctx  383")]
    triton = _bench("gpu_bench_triton_2026-11-30.json")["sync"]
    compiled = _bench("gpu_bench_compile_2026-12-01.json")["sync+compile"]
    merged = _bench("runs/gpu_merged_projections_2026-12-01/bench_8b_b32_256.json")["async+compile"]
    return {"first_graphed_ms": graph[0], "argmax_sdpa_64keys_ms": graph[5],
            "triton_ms": triton["decode_compute_ms"], "compile_ms": compiled["decode_compute_ms"],
            "merged_ms": merged["decode_compute_ms"]}


def headline() -> dict:
    """README's results table: 8B shape, 32 x 256 prompts, 256 new tokens, CUDA graphs."""
    out = {}
    for name, path in (("triton", "gpu_bench_triton_2026-11-30.json"), ("sdpa", "gpu_bench_headline_2026-11-30.json")):
        res = _bench(path)
        for mode in ("sync", "async"):
            r = res[mode]
            out.update({f"{name}_{mode}_wall_s": r["wall_s"], f"{name}_{mode}_tok_s": r["tokens_per_s"],
                        f"{name}_{mode}_busy_pct": 100 * r["device_busy"],
                        f"{name}_{mode}_decode_ms": r["decode_compute_ms"]})
        out[f"{name}_ratio"] = res["async"]["wall_s"] / res["sync"]["wall_s"]
    hf = _bench("gpu_bench_headline_2026-11-30.json")["hf_sync_graphs"]
    out.update({"hf_sync_graphs_wall_s": hf["wall_s"], "hf_sync_graphs_tok_s": hf["tokens_per_s"]})
    return out


def vs_transformers() -> dict:
    """Ours against transformers' generate_batch, each mode in a process of its own."""
    res = _bench("runs/gpu_merged_projections_2026-12-01/bench_8b_b32_256.json")
    ours, theirs, plain = res["async+compile"], res["hf_sync_graphs"], res["async"]
    return {"ours_tok_s": ours["tokens_per_s"], "hf_tok_s": theirs["tokens_per_s"], "plain_async_tok_s": plain["tokens_per_s"],
            "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "plain_speedup": plain["tokens_per_s"] / theirs["tokens_per_s"]}


def same_process() -> dict:
    """Notebook 07's section 1: every mode in one process (older step, CUDA graphs)."""
    res = _bench("gpu_bench_all_llama3-8b-shape_b32_256.json")
    best_hf = max((r for m, r in res.items() if m.startswith("hf")), key=lambda r: r["tokens_per_s"])
    return {"ratio": res["async"]["wall_s"] / res["sync"]["wall_s"],
            "compile_ratio": res["async+compile"]["wall_s"] / res["sync+compile"]["wall_s"],
            "sync_busy_pct": 100 * res["sync"]["device_busy"],
            "sync_compile_busy_pct": 100 * res["sync+compile"]["device_busy"],
            "speedup": res["async+compile"]["tokens_per_s"] / best_hf["tokens_per_s"]}


def sweep() -> dict:
    """Where async helps most: model shape x batch x context (scripts/sweep.py)."""
    rows = json.loads((DATA / "gpu_sweep_2026-12-01.json").read_text())
    one_b = [r["wall_ratio"] for r in rows if r["model"] == "llama3-1b-shape"
             and (r["context"] == 512 and r["batch"] <= 32 or r["batch"] == 1)]
    busy = [100 * r["async"]["device_busy"] for r in rows]
    return {"points": len(rows), "ratio_min": min(r["wall_ratio"] for r in rows),
            "ratio_max": max(r["wall_ratio"] for r in rows), "one_b_min": min(one_b), "one_b_max": max(one_b),
            "busy_min_pct": min(busy), "busy_max_pct": max(busy)}


def floor_matrix() -> dict:
    """The decode step at fixed batch x context against its full floor (floor_matrix.py)."""
    run = DATA / "runs" / "gpu_merged_projections_2026-12-01"
    pts = [p for part in ("floor_matrix_batches_1_32.json", "floor_matrix_batches_8_128.json")
           for p in json.loads((run / part).read_text())["points"]]
    out = {}
    for kind in ("default", "compile", "unmerged"):
        ratios = [p[kind]["ms"] / p["floor_ms"] for p in pts]
        out.update({f"{kind}_min": min(ratios), f"{kind}_max": max(ratios)})
    return out


def profile() -> dict:
    """Our busy fraction against torch.profiler's kernels (scripts/gpu/profile_async.py)."""
    first = (DATA / "gpu_profile_async_8b.txt").read_text().splitlines()[0]
    timeline, kernels = (float(x) for x in re.findall(r"([\d.]+)%", first)[:2])
    return {"timeline_busy_pct": timeline, "kernels_busy_pct": kernels, "kernels_idle_pct": 100 - kernels}


def serving() -> dict:
    """Our server against transformers serve over HTTP, and against the offline engine (H200, 8B folder)."""
    run = "runs/gpu_serving_2026-12-01/"
    http = json.loads((DATA / run / "bench_serve.json").read_text())["runs"]
    ours, warm, theirs = http["async"]["rates"], http["async-1client"]["rates"], http["transformers"]["rates"]
    offline = _bench(run + "offline_bench.json")["async"]
    shared = [k for k in theirs if k in ours]
    return {"ours_inf_tok_s": ours["inf"]["output_throughput"], "ours_inf_again_tok_s": warm["inf"]["output_throughput"],
            "tf_inf_tok_s": theirs["inf"]["output_throughput"],
            "speedup_inf": ours["inf"]["output_throughput"] / theirs["inf"]["output_throughput"],
            "ours_itl_p50_max_ms": max(ours[k]["itl_ms"]["p50"] for k in ours),
            "tf_itl_p50_min_ms": min(theirs[k]["itl_ms"]["p50"] for k in theirs),
            "ours_ttft_p50_16_ms": ours["16"]["ttft_ms"]["p50"], "tf_ttft_p50_16_ms": theirs["16"]["ttft_ms"]["p50"],
            "itl_ratio_min": min(theirs[k]["itl_ms"]["p50"] / ours[k]["itl_ms"]["p50"] for k in shared),
            "offline_async_tok_s": offline["tokens_per_s"], "offline_period_ms": offline["decode_period_ms"],
            "server_over_offline": ours["inf"]["output_throughput"] / offline["tokens_per_s"],
            "server_over_offline_again": warm["inf"]["output_throughput"] / offline["tokens_per_s"]}


def _stopped(log: str) -> dict:
    """A server's last stats, from the `minibatch: stopping; {...}` line it printed."""
    import ast

    line = next(x for x in (DATA / log).read_text().splitlines() if x.startswith("minibatch: stopping; "))
    return ast.literal_eval(line.split("; ", 1)[1])


def serving_graphs() -> dict:
    """Our server with every step graphed against decode steps only, and --compile (H200, 8B folder)."""
    run = "runs/gpu_serving_graphs_2026-12-01/"
    http = json.loads((DATA / run / "bench_serve.json").read_text())["runs"]
    every, decode = _stopped(run + "console-1.log"), _stopped(run + "console-2.log")
    offline = next(float(x.split()[2]) for x in (DATA / run / "offline.log").read_text().splitlines()
                   if x.startswith("async "))
    startup = dict(x.split("\t") for x in (DATA / run / "startup.tsv").read_text().splitlines()[1:])
    tok = {label: http[label]["rates"]["inf"]["output_throughput"]
           for label in ("async", "async-warm", "async-decode-graphs", "async-decode-graphs-warm", "async+compile")}
    return {"every_inf_tok_s": tok["async"], "every_warm_tok_s": tok["async-warm"],
            "decode_inf_tok_s": tok["async-decode-graphs"], "decode_warm_tok_s": tok["async-decode-graphs-warm"],
            "every_captures": every["graph_captures"], "every_capture_s": every["graph_capture_s"],
            "decode_captures": decode["graph_captures"], "decode_capture_s": decode["graph_capture_s"],
            "offline_async_tok_s": offline, "decode_over_offline": tok["async-decode-graphs"] / offline,
            "decode_warm_over_offline": tok["async-decode-graphs-warm"] / offline,
            "compile_inf_tok_s": tok["async+compile"],
            "compile_cold_start_s": float(startup["async+compile"]),
            "compile_warm_start_s": float(startup["async+compile-warm"])}


def serving_compile() -> dict:
    """`serve --compile` with the dynamic compile, forward and sampler apart (H200, 8B folder, 64 requests):
    the first rate-inf pass, the pass after a warm one, the offline engine, start-ups (two cold)."""
    first, run = "runs/gpu_serving_compile_2026-12-01/fixed/", "runs/gpu_serving_compile_2026-12-02/"

    def startup(path: str) -> dict:
        return {k: float(v) for k, v in (x.split("\t") for x in (DATA / path).read_text().splitlines()[1:])}

    runs = json.loads((DATA / run / "bench_serve.json").read_text())["runs"]
    cold, warm = runs["async+compile"]["rates"]["inf"], runs["async+compile-warm"]["rates"]["inf"]
    offline = _bench(run + "offline_bench.json")["async+dynamic"]
    starts = startup(run + "startup.tsv")
    colds = (startup(first + "startup.tsv")["async+compile"], starts["async+compile"])
    return {"inf_tok_s": cold["output_throughput"], "warm_inf_tok_s": warm["output_throughput"],
            "itl_p50_ms": warm["itl_ms"]["p50"], "offline_dynamic_tok_s": offline["tokens_per_s"],
            "warm_over_offline": warm["output_throughput"] / offline["tokens_per_s"],
            "offline_dynamic_decode_ms": offline["decode_period_ms"],
            "cold_start_min_s": min(colds), "cold_start_max_s": max(colds),
            "cached_start_s": starts["async+compile-cached"]}


def serving_gc() -> dict:
    """Full garbage collections: in the 8B server's timeline (H200, unfrozen heap), and one collection's
    time before and after gc.freeze on the CPU (tiny model loaded)."""
    from minibatch.core.timeline import Timeline

    spans = Timeline.load(DATA / "runs/gpu_serving_gc_2026-12-02/timeline-async-gcoff.json.gz").spans
    pauses = [1000 * s.duration for s in spans if s.name == "gc" and s.start > 60]  # after ready
    cpu = (DATA / "runs/cpu_gc_freeze_2026-12-02/gc_freeze.txt").read_text()
    before, after = (float(x) for x in re.search(r"([\d.]+) ms before the freeze, ([\d.]+) ms after", cpu).groups())
    return {"gpu_pause_min_ms": min(pauses), "gpu_pause_max_ms": max(pauses),
            "cpu_full_collect_ms": before, "cpu_frozen_collect_ms": after}


def serving_startup_graphs() -> dict:
    """Our async server with decode graphs captured lazily against at start-up (--capture-up-to 512), H200."""
    lazy_run, run = "runs/gpu_serving_on_step_delivery_2026-12-04/", "runs/gpu_serving_startup_graphs_2026-12-04/"
    lazy = json.loads((DATA / lazy_run / "bench_serve.json").read_text())["runs"]["async"]["rates"]
    log = (DATA / run / "serve_bench.log").read_text().splitlines()
    itl = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in
           (re.match(r"rate\s+(\w+):.*ITL p50/p99 ([\d.]+)/([\d.]+) ms", x) for x in log) if m}
    stopped = _stopped(run + "serve_bench.log")
    ready = dict(x.split("\t") for x in (DATA / lazy_run / "startup.tsv").read_text().splitlines()[1:])
    out = {"captures": stopped["startup_graph_captures"], "capture_s": stopped["graph_capture_s"],
           "ready_s": float(next(x.split("\t")[1] for x in log if x.startswith("async-capture512\t"))),
           "lazy_ready_s": float(ready["async"])}
    for rate in ("4", "16", "32"):
        out[f"lazy_itl_p99_r{rate}"] = lazy[rate]["itl_ms"]["p99"]
        out[f"itl_p99_r{rate}"] = itl[rate][1]
        out[f"itl_p99_over_p50_r{rate}"] = itl[rate][1] / itl[rate][0]
        out[f"lazy_itl_p99_over_p50_r{rate}"] = lazy[rate]["itl_ms"]["p99"] / lazy[rate]["itl_ms"]["p50"]
    return out


def serving_all_graphs() -> dict:
    """Sync and async servers, default (decode graphs, lazy) against every step a graph captured at start-up
    (--cuda-graphs on --capture-up-to 512), and the async one's token budget 512/1024/2048; one H200."""
    run = "runs/gpu_serving_all_graphs_startup_2026-12-04/"
    runs = json.loads((DATA / run / "bench_serve.json").read_text())["runs"]
    ready = dict(x.split("\t") for x in (DATA / run / "startup.tsv").read_text().splitlines()[1:])
    stopped = _stopped(run + "server-async-allgraphs-capture512.log")
    out = {"captures": stopped["startup_graph_captures"], "capture_s": stopped["graph_capture_s"],
           "ready_s": float(ready["async-allgraphs-capture512"]), "lazy_ready_s": float(ready["async"])}
    labels = {"sync": "sync", "async": "async", "sync_all": "sync-allgraphs-capture512",
              "async_all": "async-allgraphs-capture512", "async_all_b512": "async-allgraphs-capture512-mbt512",
              "async_all_b1024": "async-allgraphs-capture512-mbt1024"}
    for short, label in labels.items():
        for rate, r in runs[label]["rates"].items():
            out[f"{short}_ttft_p50_r{rate}"] = r["ttft_ms"]["p50"]
            out[f"{short}_itl_p50_r{rate}"] = r["itl_ms"]["p50"]
            out[f"{short}_itl_p99_r{rate}"] = r["itl_ms"]["p99"]
            out[f"{short}_itl_ratio_r{rate}"] = r["itl_ms"]["p99"] / r["itl_ms"]["p50"]
            out[f"{short}_tok_s_r{rate}"] = r["output_throughput"]
    return out


def small_models() -> dict:
    """Small models' compiled decode step with the few-row products on speed/skinny.py's kernel against all
    on cuBLAS (floor_matrix.py --skinny-ab), and the products alone (skinny_gemv_ab.py); one H200."""
    run = DATA / "runs/gpu_small_models_skinny_2026-12-04/"
    out = {}
    for key, p in _small_model_points(run, {"compile": "skinny", "cublas": "cublas"}, out):
        for path, name in (("compile", "skinny"), ("cublas", "cublas")):
            out[f"{key}_{name}_kernels"] = p[path]["kernels"]["kernels"]
        out[f"{key}_routed"] = p["compile"]["routed"]
    gemv = json.loads((run / "skinny_gemv_qwen3-0.6b-shape.json").read_text())
    for rows in ("1", "4", "8"):
        t = gemv["total"][rows]
        out[f"q06_products_m{rows}_cublas_ms"] = t["cublas_ms"]
        out[f"q06_products_m{rows}_best_ms"] = t["best_ms"]
        out[f"q06_products_floor_ms"] = t["floor_ms"]
    for name in ("o", "down"):
        for rows in ("1", "4"):
            r = gemv["shapes"][name][rows]
            out[f"q06_{name}_m{rows}_speedup"] = r["cublas_ms"] / r["triton_ms"]
    return out


def small_models_pdl() -> dict:
    """Small models' compiled decode step as it runs by default (kernels launched early: programmatic
    dependent launch) against the same step without it (floor_matrix.py --variants late:...); one H200."""
    run = DATA / "runs/gpu_small_models_pdl_2026-12-04/"
    out = {}
    for key, p in _small_model_points(run, {"compile": "early", "late": "late"}, out):
        out[f"{key}_saved_ms"] = p["late"]["ms"] - p["compile"]["ms"]
        if p["compile"]["kernels"]:
            out[f"{key}_late_gaps_ms"] = p["late"]["kernels"]["gaps"]
    return out


def small_models_combo() -> dict:
    """Small models' compiled decode step as it runs by default (Inductor's combo kernels where timed faster,
    the vocabulary's argmax in two steps) against the same step without combo kernels (--variants
    separate:...); and, from an earlier run of the same day, the argmax in two steps against one reduction
    (--variants one_argmax:argmax=0); one H200."""
    run = DATA / "runs/gpu_small_models_combo_2026-12-04/"
    out = {}
    for key, p in _small_model_points(run, {"compile": "combined", "separate": "separate"}, out):
        if "separate" in p:
            out[f"{key}_saved_ms"] = p["separate"]["ms"] - p["compile"]["ms"]
            out[f"{key}_kernels_fewer"] = p["separate"]["kernels"]["kernels"] - p["compile"]["kernels"]["kernels"]
    for p in json.loads((run / "2_argmax_combo_bench_qwen3-0.6b-shape.json").read_text())["points"]:
        key = f"q06_b{p['batch']}"
        out[f"{key}_argmax_saved_ms"] = p["one_argmax"]["ms"] - p["compile"]["ms"]
        out[f"{key}_one_argmax_us"] = 1e3 * _kernel_ms(p["one_argmax"], "argmax")
        out[f"{key}_two_step_argmax_us"] = 1e3 * (_kernel_ms(p["compile"], "_max_") + _kernel_ms(p["compile"], "argmax"))
    return out


def small_models_switches() -> dict:
    """The 0.6B shape's compiled decode step against the four levers built off by default (floor_matrix.py
    --variants: wide, fold, all / nofold), then with the decode kernel's 2 warps and 2 stages against
    Triton's defaults (--variants defaults:lean=0); and that kernel alone at both shapes
    (decode_kernel_tune.py); one H200."""
    run = DATA / "runs/gpu_small_models_switches_2026-12-05/"
    out = _floor_paths(run, lambda f: "lean" if f.stem.endswith("_lean") else "switches")
    for model, short in (("qwen3-0.6b-shape", "q06"), ("llama3-8b-shape", "l8b")):
        for f in run.glob(f"*_decode_kernel_tune_{model}.json"):
            for p in json.loads(f.read_text())["points"]:
                key = f"{short}_attention_{p['rows']}x{p['context']}"
                out[f"{key}_shipped_ms"] = p["shipped_ms"]
                out[f"{key}_folded_ms"] = p["folded_ms"]
                out[f"{key}_best_ms"] = p["best_ms"]
                if "defaults_ms" in p:
                    out[f"{key}_defaults_ms"] = p["defaults_ms"]
    return out


def small_models_fresh() -> dict:
    """The 0.6B shape's compiled decode step with q/k/v handed to the decode kernel (fresh) and that with the
    residual add and RMSNorm inside skinny.py's products under the wide rule (prenorm), against the default
    compiled step: one process for batches 1, 4 and 8, then fresh alone again at 1 and at 4 and 8; one H200."""
    return _by_command("gpu_small_models_fresh_2026-12-05")


def small_models_apart() -> dict:
    """The 0.6B shape's compiled decode step with fresh's new key on a program of its own (apart), then with
    silu(gate) * up in the down product (glu, since removed), skinny.py's K in one piece (all), the splits
    combined inside the decode kernel (one..., since removed), against the default compiled step and fresh
    with the first split folding in the new key; one H200, one process per command."""
    return _by_command("gpu_small_models_apart_2026-12-05")


def small_models_prefetch() -> dict:
    """The 0.6B shape's compiled decode step with the next products' weights asked into L2 (speed/ahead.py, since
    removed): by our kernels (ahead, early), by the attention alone (attn), by a kernel on a second stream (side,
    cside), against the default compiled step and fresh's path (apart); two H100s (commands 2 and 3) and an H200
    (command 5), one process per command."""
    return _by_command("gpu_small_models_prefetch_2026-12-05")


def small_models_defer() -> dict:
    """The 0.6B shape's compiled decode step with skinny.py's K of 2048 in one piece (one) and its 2-4 rows'
    products summed once after the loop (defer), against the default compiled step and fresh's path (apart);
    one H100, one process per command."""
    return _by_command("gpu_small_models_defer_2026-12-05")


def small_models_gated() -> dict:
    """silu(gate) * up inside skinny.py's gate/up product (gated.py): the product alone against cuBLAS's and
    PyTorch's activation ops (ab_gated_m{rows}_...), and the 0.6B compiled step with it (gated) or without it
    (ungated), with fresh's path (apart), q/k/v on the kernel at one row too (wide), 5-8 rows of the narrow
    products on it (rows8); one H100 for commands 1-2, another for command 3."""
    run = "gpu_small_models_gated_2026-12-05"
    out = _by_command(run)
    gate_up = json.loads((DATA / "runs" / run / "2_skinny_gemv_gated_qwen3-0.6b-shape.json").read_text())["shapes"]
    for rows, t in gate_up["gate_up"].items():
        if rows.isdigit():
            out[f"ab_gated_m{rows}_cublas_ms"], out[f"ab_gated_m{rows}_kernel_ms"] = t["cublas_ms"], t["triton_ms"]
    return out


def small_models_many_rows() -> dict:
    """gated.py at 2-8 rows too (MANY_ROWS, now the default: compile) against one row only (few), fresh's path
    (fresh), with q/k/v on skinny.py's kernel at one row too (wide), in the 0.6B compiled step; and the 1B's
    default compiled step (l1b_...); one H100, commands 2-4 on one machine."""
    run = "gpu_small_models_many_rows_2026-12-05"
    return {**_by_command(run), **_l1b_paths(run, "4_floor_matrix_llama3-1b-shape_b1_4_8", ("compile",))}


def small_models_gated_tiles() -> dict:
    """gated.py's 2-8-row tiles (K in pieces of 128, 5 stages) from a wider grid: the product alone against the
    old setting and cuBLAS's product alone (gated_...), the 0.6B step with them (run6) against without (run5),
    the norm inside the gated kernel (run2 norm, freshnorm), the default with them at 1/4/8 rows beside fresh's
    path (run7) and again at 4 rows (run8, run9), the 1B's default and fresh steps (l1b_...); H100s."""
    run = "gpu_small_models_gated_tiles_2026-12-05"
    out = _by_command(run)
    ab = json.loads((DATA / "runs" / run / "4_skinny_gemv_gated_qwen3-0.6b-shape.json").read_text())["shapes"]["gate_up"]
    for m in ("4", "8"):
        out[f"gated_b{m}_ms"] = ab[m]["triton_ms"]
        out[f"gated_b{m}_cublas_product_ms"] = ab["cublas_product_ms"][m]
        old = dict(block_n=32, block_k=256, warps=4, stages=4, split=1, dot=True)
        out[f"gated_b{m}_old_ms"] = next(t for t, c in ab[m]["all"] if c == old)
    return {**out, **_l1b_paths(run, "10_floor_matrix_llama3-1b-shape_b1_4_8", ("compile", "fresh"))}


def small_models_qkv() -> dict:
    """The 0.6B merged q/k/v product on skinny.py's kernel: alone, cuBLAS against the kernel's best of 72 tiles
    and the shipped plain setting (qkv_m{rows}_...); the 0.6B compiled step (run2) with q/k/v on cuBLAS
    (compile, the default then) against it on the best tile per row count (wide), the decode kernel's preload
    (pre) and both (widepre); and (run4, another H100) that as the default (compile, skinny.SHORT_K) against
    q/k/v on cuBLAS (cublasqkv) and without fresh's path (nofresh)."""
    run = "gpu_small_models_qkv_2026-12-06"
    out = _by_command(run)
    qkv = json.loads((DATA / "runs" / run / "1_skinny_gemv_qkv_tiles_qwen3-0.6b-shape.json").read_text())["shapes"]["qkv"]
    for m in ("1", "4", "8"):
        out[f"qkv_m{m}_cublas_ms"], out[f"qkv_m{m}_kernel_ms"] = qkv[m]["cublas_ms"], qkv[m]["triton_ms"]
    return out


def small_models_target() -> dict:
    """The small models' default compiled step against its floor at this tree: the 0.6B (run1: compile, the default,
    against nofresh and cublasqkv; run4: the decode attention's programs per SM, sm4 and sm1) and the 1B (l1b_...:
    compile and nofresh, with the default's first call in seconds); one H100."""
    run = "gpu_small_models_target_2026-12-06"
    return {**_by_command(run), **_l1b_paths(run, "2_floor_matrix_llama3-1b-shape_b1_4_8", ("compile", "nofresh")),
            **_first_calls(run)}


def small_models_target_h200() -> dict:
    """The small models' default compiled step against its floor on an H200, the kernels of small_models_target's
    tree: the 0.6B (run1: compile, with q06_b{batch}_compile_s its first call in seconds) and the 1B (l1b_...)."""
    run = "gpu_small_models_target_h200_2026-12-06"
    return {**_by_command(run), **_l1b_paths(run, "2_floor_matrix_llama3-1b-shape_b1_4_8", ("compile",)),
            **_first_calls(run)}


def _first_calls(folder: str) -> dict:
    """The default compile's first call in seconds, {q06|l1b}_b{batch}_compile_s, from a target run's two floor
    matrices (1_: the 0.6B shape, 2_: the 1B shape, batches 1, 4 and 8)."""
    out = {}
    for name, key in (("1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "q06"), ("2_floor_matrix_llama3-1b-shape_b1_4_8", "l1b")):
        for p in json.loads((DATA / "runs" / folder / f"{name}.json").read_text())["points"]:
            out[f"{key}_b{p['batch']}_compile_s"] = p["compile"]["first_call_s"]
    return out


def small_models_attn() -> dict:
    """The decode attention's (keys per loop step, warps, stages) inside the 0.6B compiled step at 4 and 8 rows
    (run1): the shipped 64 / 2 / 2 (compile) against k128w4, k128w2, k64w4 and k64s3; one H100."""
    return _by_command("gpu_decode_attn_settings_2026-12-06")


def small_models_l2_bulk() -> dict:
    """The weights after each decode attention asked into L2 in bulk (not kept): the 0.6B step (run1: compile
    against l2 and l2next; run4 at 4 rows, with the decode kernel's and skinny.py's ms per step, *_decode_ms and
    *_skinny_ms) and the 1B (l1b_...: compile against l2); one H100 (run4 another)."""
    run = "gpu_small_models_l2_bulk_2026-12-06"
    out = {**_by_command(run), **_l1b_paths(run, "2_floor_matrix_llama3-1b-shape_b1_4_8", ("compile", "l2"))}
    (point,) = json.loads((DATA / "runs" / run / "4_floor_matrix_qwen3-0.6b-shape_b4.json").read_text())["points"]
    for path in ("compile", "l2"):
        for part, name in (("decode", "attention: _decode_kernel"), ("skinny", "matmul: _skinny_kernel")):
            out[f"q06_b4_run4_{path}_{part}_ms"] = sum(ms for n, ms, _ in point[path]["kernels"]["top"] if n == name)
    return out


def small_models_levers() -> dict:
    """Three levers on the 0.6B step, none kept (one H100 each run): the first weights read before waiting (run1:
    hoist, per_sm=1 as sm1, both, the default again), 8-row products on the tensor-core tile (run3: down8, o8,
    both8, down8h) and Inductor's combo kernels off (run4: nocombo, again)."""
    return _by_command("gpu_small_models_hoist_tiles_combo_2026-12-06")


def small_models_rotary() -> dict:
    """One rotary cos and sin for every layer's decode attention (one H100 each run): the flexible layout (run1),
    it with the kernel's strided reads (run4), the operator's layout rule, kept (run6); each default (compile)
    against a copy per layer (rotary0) and the default again."""
    return _by_command("gpu_small_models_rotary_2026-12-06")


def small_models_outer_splits() -> dict:
    """The rotary angles' one-term product as a multiply (run1: outer, with per_sm=1 as sm1 and the default again);
    splits of at least 128 keys from 2 rows on (4 since), the default of run2 (split64: the old rule; split1: the
    rule at 1 row too; the default again); the first norm as a persistent kernel (run5: persistent, then off by
    default); the shipped step with all three, timed twice (run7); one H100 each run."""
    return _by_command("gpu_small_models_outer_splits_2026-12-06")


def small_models_shipped() -> dict:
    """The shipped small-model step in one run on an H100 (tree 42cbedb): the 0.6B (run3, its second process) and the
    1B (l1b_...), with each shape's first call in seconds from its first process's log ({q06|l1b}_b{batch}_compile_s:
    the 0.6B's JSON of that process was overwritten, its table kept only in the log)."""
    run = "gpu_small_models_shipped_2026-12-06"
    out = {**_by_command(run), **_l1b_paths(run, "2_floor_matrix_llama3-1b-shape_b1_4_8", ("compile",))}
    logs = {"q06": "1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "l1b": "2_floor_matrix_llama3-1b-shape_b1_4_8"}
    for key, name in logs.items():
        log = (DATA / "runs" / run / f"{name}.log").read_text()
        for batch, s in re.findall(r"^ +(\d+) +512 .*\(compile: first call ([\d.]+) s\)", log, re.M):
            out[f"{key}_b{batch}_compile_s"] = float(s)
    return out


def _by_command(folder: str) -> dict:
    """`_floor_paths` of a run folder whose files are numbered by the command that wrote them: keys ..._run{N}_..."""
    return _floor_paths(DATA / "runs" / folder, lambda f: "run" + f.stem.split("_")[0])


def _l1b_paths(folder: str, name: str, paths: tuple) -> dict:
    """The 1B floor matrix `name`.json of a run folder: per batch its floor and each of `paths`' ms and multiple of
    the floor, keyed l1b_b{batch}_..."""
    out = {}
    for p in json.loads((DATA / "runs" / folder / f"{name}.json").read_text())["points"]:
        key = f"l1b_b{p['batch']}"
        out[f"{key}_floor_ms"] = p["floor_ms"]
        for path in paths:
            out[f"{key}_{path}_ms"], out[f"{key}_{path}_x"] = p[path]["ms"], p[path]["over_floor"]
    return out


def _floor_paths(run: Path, stage) -> dict:
    """Each compiled path of the 0.6B floor matrices in `run`, keyed q06_b{batch}_{stage(file)}_{path}: its ms,
    its multiple of the floor and, where the run listed kernels (--kernels), their count and the ms by kind."""
    out = {}
    for f in sorted(run.glob("*_floor_matrix_qwen3-0.6b-shape_*.json")):
        for p in json.loads(f.read_text())["points"]:
            key = f"q06_b{p['batch']}_{stage(f)}"
            out[f"{key}_floor_ms"] = p["floor_ms"]
            for path, v in p.items():
                if isinstance(v, dict) and "ms" in v and path != "default":
                    out[f"{key}_{path}_ms"] = v["ms"]
                    out[f"{key}_{path}_x"] = v["over_floor"]
                    for part in ("kernels", "matmul", "attention", "other"):
                        if part in (v.get("kernels") or {}):
                            out[f"{key}_{path}_{part}"] = v["kernels"][part]
    return out


def _kernel_ms(path: dict, part: str) -> float:
    """ms per step of the kernels in a floor-matrix path's --kernels top list whose name holds `part`."""
    return sum(ms for name, ms, _ in path["kernels"]["top"] if part in name and name.startswith("other:"))


def _small_model_points(run: Path, paths: dict, out: dict):
    """The 0.6B and 1B floor matrices of `run` (floor_matrix_MODEL*.json: one run may have come back in
    parts): for each point, its floor, each path's ms and x floor (named by `paths`, where the point has the
    path) and the default compile's first-call seconds go into `out` under "q06_b1_..." keys; yields (key
    prefix, point) for the rest."""
    for model, short in (("qwen3-0.6b-shape", "q06"), ("llama3-1b-shape", "l1b")):
        for p in (p for f in sorted(run.glob(f"floor_matrix_{model}*.json")) for p in json.loads(f.read_text())["points"]):
            key = f"{short}_b{p['batch']}"
            out[f"{key}_floor_ms"] = p["floor_ms"]
            for path, name in paths.items():
                if path in p:
                    out[f"{key}_{name}_ms"] = p[path]["ms"]
                    out[f"{key}_{name}_x"] = p[path]["over_floor"]
            out[f"{key}_compile_s"] = p["compile"]["first_call_s"]
            yield key, p


SECTIONS = {"decode_step": decode_step, "headline": headline, "vs_transformers": vs_transformers,
            "same_process": same_process, "sweep": sweep, "floor_matrix": floor_matrix, "profile": profile,
            "serving": serving, "serving_graphs": serving_graphs, "serving_compile": serving_compile,
            "serving_gc": serving_gc, "serving_startup_graphs": serving_startup_graphs,
            "serving_all_graphs": serving_all_graphs, "small_models": small_models,
            "small_models_pdl": small_models_pdl, "small_models_combo": small_models_combo,
            "small_models_switches": small_models_switches, "small_models_fresh": small_models_fresh,
            "small_models_apart": small_models_apart, "small_models_prefetch": small_models_prefetch,
            "small_models_defer": small_models_defer, "small_models_gated": small_models_gated,
            "small_models_many_rows": small_models_many_rows, "small_models_gated_tiles": small_models_gated_tiles,
            "small_models_qkv": small_models_qkv, "small_models_target": small_models_target,
            "small_models_attn": small_models_attn, "small_models_l2_bulk": small_models_l2_bulk,
            "small_models_levers": small_models_levers, "small_models_rotary": small_models_rotary,
            "small_models_outer_splits": small_models_outer_splits,
            "small_models_target_h200": small_models_target_h200, "small_models_shipped": small_models_shipped}
SOURCES = {"decode_step": ["figures/data/gpu_step_ab_8b.txt", "figures/data/gpu_bench_triton_2026-11-30.json",
                           "figures/data/gpu_bench_compile_2026-12-01.json",
                           "figures/data/runs/gpu_merged_projections_2026-12-01/bench_8b_b32_256.json"],
           "headline": ["figures/data/gpu_bench_triton_2026-11-30.json", "figures/data/gpu_bench_headline_2026-11-30.json"],
           "vs_transformers": ["figures/data/runs/gpu_merged_projections_2026-12-01/bench_8b_b32_256.json"],
           "same_process": ["figures/data/gpu_bench_all_llama3-8b-shape_b32_256.json"],
           "sweep": ["figures/data/gpu_sweep_2026-12-01.json"],
           "floor_matrix": ["figures/data/runs/gpu_merged_projections_2026-12-01/floor_matrix_batches_1_32.json",
                            "figures/data/runs/gpu_merged_projections_2026-12-01/floor_matrix_batches_8_128.json"],
           "profile": ["figures/data/gpu_profile_async_8b.txt"],
           "serving": ["figures/data/runs/gpu_serving_2026-12-01/bench_serve.json",
                       "figures/data/runs/gpu_serving_2026-12-01/offline_bench.json"],
           "serving_graphs": ["figures/data/runs/gpu_serving_graphs_2026-12-01/bench_serve.json",
                              "figures/data/runs/gpu_serving_graphs_2026-12-01/console-1.log",
                              "figures/data/runs/gpu_serving_graphs_2026-12-01/console-2.log",
                              "figures/data/runs/gpu_serving_graphs_2026-12-01/offline.log",
                              "figures/data/runs/gpu_serving_graphs_2026-12-01/startup.tsv"],
           "serving_compile": ["figures/data/runs/gpu_serving_compile_2026-12-02/bench_serve.json",
                               "figures/data/runs/gpu_serving_compile_2026-12-02/offline_bench.json",
                               "figures/data/runs/gpu_serving_compile_2026-12-02/startup.tsv",
                               "figures/data/runs/gpu_serving_compile_2026-12-01/fixed/startup.tsv"],
           "serving_gc": ["figures/data/runs/gpu_serving_gc_2026-12-02/timeline-async-gcoff.json.gz",
                          "figures/data/runs/cpu_gc_freeze_2026-12-02/gc_freeze.txt"],
           "serving_startup_graphs": ["figures/data/runs/gpu_serving_on_step_delivery_2026-12-04/bench_serve.json",
                                      "figures/data/runs/gpu_serving_on_step_delivery_2026-12-04/startup.tsv",
                                      "figures/data/runs/gpu_serving_startup_graphs_2026-12-04/serve_bench.log"],
           "serving_all_graphs": ["figures/data/runs/gpu_serving_all_graphs_startup_2026-12-04/bench_serve.json",
                                  "figures/data/runs/gpu_serving_all_graphs_startup_2026-12-04/startup.tsv",
                                  "figures/data/runs/gpu_serving_all_graphs_startup_2026-12-04/"
                                  "server-async-allgraphs-capture512.log"],
           "small_models": ["figures/data/runs/gpu_small_models_skinny_2026-12-04/floor_matrix_qwen3-0.6b-shape.json",
                            "figures/data/runs/gpu_small_models_skinny_2026-12-04/floor_matrix_llama3-1b-shape.json",
                            "figures/data/runs/gpu_small_models_skinny_2026-12-04/skinny_gemv_qwen3-0.6b-shape.json"],
           "small_models_pdl": ["figures/data/runs/gpu_small_models_pdl_2026-12-04/floor_matrix_qwen3-0.6b-shape.json",
                                "figures/data/runs/gpu_small_models_pdl_2026-12-04/floor_matrix_llama3-1b-shape.json"],
           "small_models_combo": [f"figures/data/runs/gpu_small_models_combo_2026-12-04/{f}.json" for f in (
               "floor_matrix_qwen3-0.6b-shape", "floor_matrix_qwen3-0.6b-shape_b8", "floor_matrix_llama3-1b-shape",
               "2_argmax_combo_bench_qwen3-0.6b-shape")],
           "small_models_switches": [f"figures/data/runs/gpu_small_models_switches_2026-12-05/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1", "2_floor_matrix_qwen3-0.6b-shape_b4",
               "2_floor_matrix_qwen3-0.6b-shape_b8", "3_decode_kernel_tune_qwen3-0.6b-shape",
               "4_decode_kernel_tune_llama3-8b-shape", "4_floor_matrix_qwen3-0.6b-shape_lean")],
           "small_models_fresh": [f"figures/data/runs/gpu_small_models_fresh_2026-12-05/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "3_floor_matrix_qwen3-0.6b-shape_b1",
               "4_floor_matrix_qwen3-0.6b-shape_b4_8")],
           "small_models_apart": [f"figures/data/runs/gpu_small_models_apart_2026-12-05/{f}.json" for f in (
               "2_floor_matrix_qwen3-0.6b-shape_b1", "4_floor_matrix_qwen3-0.6b-shape_b4_8",
               "6_floor_matrix_qwen3-0.6b-shape_b1_4_8")],
           "small_models_prefetch": [f"figures/data/runs/gpu_small_models_prefetch_2026-12-05/{f}.json" for f in (
               "2_floor_matrix_qwen3-0.6b-shape_b1_4", "3_floor_matrix_qwen3-0.6b-shape_b8_1_4",
               "5_floor_matrix_qwen3-0.6b-shape_b1_4_8")],
           "small_models_defer": [f"figures/data/runs/gpu_small_models_defer_2026-12-05/{f}.json" for f in (
               "2_floor_matrix_qwen3-0.6b-shape_b4", "3_floor_matrix_qwen3-0.6b-shape_b1")],
           "small_models_gated": [f"figures/data/runs/gpu_small_models_gated_2026-12-05/{f}.json" for f in (
               "2_skinny_gemv_gated_qwen3-0.6b-shape", "3_floor_matrix_qwen3-0.6b-shape_b4",
               "5_floor_matrix_qwen3-0.6b-shape_b8", "6_floor_matrix_qwen3-0.6b-shape_b1",
               "8_floor_matrix_qwen3-0.6b-shape_b1_4")],
           "small_models_many_rows": [f"figures/data/runs/gpu_small_models_many_rows_2026-12-05/{f}.json" for f in (
               "2_floor_matrix_qwen3-0.6b-shape_b1_4", "3_floor_matrix_qwen3-0.6b-shape_b8",
               "4_floor_matrix_llama3-1b-shape_b1_4_8")],
           "small_models_gated_tiles": [f"figures/data/runs/gpu_small_models_gated_tiles_2026-12-05/{f}.json" for f in (
               "2_floor_matrix_qwen3-0.6b-shape_b4", "4_skinny_gemv_gated_qwen3-0.6b-shape",
               "5_floor_matrix_qwen3-0.6b-shape_b4_before", "6_floor_matrix_qwen3-0.6b-shape_b4_tiles",
               "7_floor_matrix_qwen3-0.6b-shape_b1_4_8", "8_floor_matrix_qwen3-0.6b-shape_b4_again",
               "9_floor_matrix_qwen3-0.6b-shape_b4_again", "10_floor_matrix_llama3-1b-shape_b1_4_8")],
           "small_models_qkv": [f"figures/data/runs/gpu_small_models_qkv_2026-12-06/{f}.json" for f in (
               "1_skinny_gemv_qkv_tiles_qwen3-0.6b-shape", "2_floor_matrix_qwen3-0.6b-shape_b1_4_8",
               "4_floor_matrix_qwen3-0.6b-shape_b1_4_8")],
           "small_models_target": [f"figures/data/runs/gpu_small_models_target_2026-12-06/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "2_floor_matrix_llama3-1b-shape_b1_4_8",
               "4_floor_matrix_qwen3-0.6b-shape_b4_8")],
           "small_models_attn": ["figures/data/runs/gpu_decode_attn_settings_2026-12-06/"
                                 "1_floor_matrix_qwen3-0.6b-shape_b4_8.json"],
           "small_models_l2_bulk": [f"figures/data/runs/gpu_small_models_l2_bulk_2026-12-06/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "2_floor_matrix_llama3-1b-shape_b1_4_8",
               "4_floor_matrix_qwen3-0.6b-shape_b4")],
           "small_models_target_h200": [f"figures/data/runs/gpu_small_models_target_h200_2026-12-06/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "2_floor_matrix_llama3-1b-shape_b1_4_8")],
           "small_models_levers": [f"figures/data/runs/gpu_small_models_hoist_tiles_combo_2026-12-06/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b4", "3_floor_matrix_qwen3-0.6b-shape_b8",
               "4_floor_matrix_qwen3-0.6b-shape_b4_8")],
           "small_models_rotary": [f"figures/data/runs/gpu_small_models_rotary_2026-12-06/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b4_8", "4_floor_matrix_qwen3-0.6b-shape_b4_8",
               "6_floor_matrix_qwen3-0.6b-shape_b4_8")],
           "small_models_outer_splits": [
               f"figures/data/runs/gpu_small_models_outer_splits_2026-12-06/{f}.json" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1_4_8", "2_floor_matrix_qwen3-0.6b-shape_b1_4_8",
               "5_floor_matrix_qwen3-0.6b-shape_b1_4_8", "7_floor_matrix_qwen3-0.6b-shape_b1_4_8")],
           "small_models_shipped": [f"figures/data/runs/gpu_small_models_shipped_2026-12-06/{f}" for f in (
               "1_floor_matrix_qwen3-0.6b-shape_b1_4_8.log", "2_floor_matrix_llama3-1b-shape_b1_4_8.log",
               "2_floor_matrix_llama3-1b-shape_b1_4_8.json", "3_floor_matrix_qwen3-0.6b-shape_b1_4_8.json")]}


def derive() -> dict:
    """headline.json's contents, derived from the recorded runs."""
    return {name: {"sources": SOURCES[name], **{k: round(v, 4) if isinstance(v, float) else v for k, v in fn().items()}}
            for name, fn in SECTIONS.items()}


if __name__ == "__main__":  # rewrite figures/data/headline.json after a new recording is committed
    (DATA / "headline.json").write_text(json.dumps(derive(), indent=1) + "\n")
