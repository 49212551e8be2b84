"""The serving subcommands of the command line: `python -m minibatch serve` (serving/server.py) and
`bench-serve` (serving/bench_serve.py); cli.py adds them to its parser."""

from __future__ import annotations

import argparse
import math
import os
import sys

from .cli_args import _GRAPHS, _float, _int, _writable


def _rates(arg: str) -> list[float]:
    try:
        rates = [float(r) for r in arg.split(",") if r]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"takes positive request rates per second or inf, comma-separated, "
                                         f"got {arg!r}")
    return rates


def _slo(arg: str) -> dict:
    from ..serving.bench_report import parse_slo
    try:
        return parse_slo(arg)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_cmd(args) -> None:
    from ..model.model import load_model
    from ..serving import guard
    from ..serving.server import serve

    if args.timeline is not None:  # refused now, not after the whole run when the server stops
        _writable(os.path.dirname(os.path.abspath(args.timeline)), "--timeline")
    options = guard.ServeOptions(host=args.host, port=args.port, api_key=args.api_key, max_body_mb=args.max_body_mb,
                                 body_timeout=args.body_timeout, engine_timeout=args.engine_timeout,
                                 grace_period=args.grace_period, docs=args.docs, timeline=args.timeline,
                                 loop=args.loop, http=args.http, gc_freeze=args.gc_freeze == "on",
                                 switch_interval_ms=args.switch_interval_ms)
    try:  # before the model loads: a port in use is known in a moment, not after the load
        sock = guard.bind(args.host, args.port)
    except OSError as e:  # a user error (exit status 2, cli.main), in one line
        raise OSError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (another server there? "
                      "choose another --port)") from None
    try:
        model = load_model(args.model, device=args.device, dtype=args.dtype)
        code = serve(model, args.served_model_name or args.model, options, sock, mode=args.mode,
                     max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                     block_size=args.block_size, num_blocks=args.num_blocks, max_queue=args.max_queue,
                     compile=args.compile, cuda_graphs=_GRAPHS[args.cuda_graphs],
                     prefix_caching=args.prefix_caching == "on", capture_up_to=args.capture_up_to)
    finally:  # (after a bad option: the port is free again for the next try)
        sock.close()
    # the engine is closed and its device released by now; what is left is the interpreter tearing down
    # torch's modules, which takes seconds on a busy machine while whoever sent SIGTERM waits for the exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bench_serve_cmd(args) -> None:
    from ..serving import bench_serve

    _writable(args.out)
    if args.token_prompts and args.endpoint == "chat":
        raise ValueError("--token-prompts needs the completions endpoint (chat messages are text)")
    raise SystemExit(bench_serve.main(args))


def add_serving(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, SSE streams)")
    s.add_argument("--model", default="tiny", help="tiny, a built-in shape, a model folder or a hub id")
    s.add_argument("--served-model-name", default=None, help="the id in /v1/models (default: --model)")
    s.add_argument("--mode", choices=["sync", "async"], default="async")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_int(0, 65535), default=8000)
    s.add_argument("--device", default="auto", help="auto, cpu or cuda")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on the CPU, bfloat16 on a GPU")
    s.add_argument("--compile", action="store_true",
                   help="decode steps through torch.compile (CUDA), compiled at start: one compile of the forward "
                        "serves every batch size and sampling variant (compile=\"dynamic\")")
    s.add_argument("--cuda-graphs", choices=list(_GRAPHS), default="auto",
                   help="replay steps as CUDA graphs: decode (auto's choice on CUDA) graphs decode steps only, and "
                        "prefill and mixed steps, whose shapes follow the arrivals, run eagerly instead of being "
                        "captured while requests wait; on graphs every step; off none")
    s.add_argument("--capture-up-to", type=_int(0), default=0, metavar="TOKENS",
                   help="before the server is ready, capture the decode CUDA graphs of requests up to TOKENS tokens "
                        "(prompt and output), every batch size, greedy and sampled, so that no capture holds a "
                        "running request back later; with --cuda-graphs on the prefill and mixed steps' graphs too, "
                        "padded to coarser sizes; costs start-up time (0, the default: capture as shapes come)")
    s.add_argument("--max-batch-size", type=_int(1), default=32)
    s.add_argument("--max-batch-tokens", type=_int(1), default=512)
    s.add_argument("--block-size", type=_int(1), default=16)
    s.add_argument("--num-blocks", type=_int(1), default=None, help="KV cache blocks (default: the engine's)")
    s.add_argument("--switch-interval-ms", type=_float(0.0, low_open=True), default=None,
                   help="how long a Python thread may hold the GIL while another waits for it (Python's "
                        "default: 5 ms); the HTTP event loop and the engine's loop share one interpreter")
    s.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                   help="requests whose prompts start alike share the KV blocks of that start (the same tokens either way)")
    s.add_argument("--gc-freeze", choices=["on", "off"], default="on",
                   help="once warm, keep the objects alive then (modules, model, compiled code) out of Python's full "
                        "garbage collections, each of which would stop every request while it walks them all")
    s.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="uvicorn's event loop (auto: uvloop where installed)")
    s.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                   help="uvicorn's HTTP parser (auto: httptools where installed)")
    s.add_argument("--timeline", default=None, metavar="FILE",
                   help="write the engine's timeline (every step's spans, each request's arrival) to FILE as JSON "
                        "when the server stops; minibatch.Timeline.load(FILE).plot() draws it")
    s.add_argument("--max-queue", type=_int(1), default=None,
                   help="waiting requests beyond which the server answers 503 (default: no limit)")
    _add_guards(s)
    s.set_defaults(func=serve_cmd)
    _add_bench_serve(sub)


def _add_guards(s) -> None:
    """serve's flags for who may call it and what it takes (serving/guard.py)."""
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: the MINIBATCH_API_KEY "
                        "environment variable; none if unset); /health stays open")
    s.add_argument("--max-body-mb", type=_float(0.0, low_open=True), default=4.0,
                   help="the largest request body in MiB (413 beyond it)")
    s.add_argument("--body-timeout", type=_float(0.0, low_open=True), default=30.0,
                   help="seconds a client may take to send its request body (408 after)")
    s.add_argument("--engine-timeout", type=_float(0.0, low_open=True), default=60.0,
                   help="seconds one engine step may take while requests wait before the engine counts as dead "
                        "(/health 503, open requests end with an error, the server exits with status 3)")
    s.add_argument("--grace-period", type=_float(0.0), default=30.0,
                   help="on SIGTERM or Ctrl-C: seconds running requests get to finish before they are ended")
    s.add_argument("--docs", action="store_true", help="serve the API's pages at /docs and /openapi.json")


def _add_bench_serve(sub) -> None:
    b = sub.add_parser("bench-serve", help="TTFT, TPOT, ITL, throughput of any OpenAI-compatible server")
    b.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", default=None, help="default: the first id of /v1/models")
    b.add_argument("--rates", type=_rates, required=True, help="requests per second, comma-separated; inf: all at once")
    b.add_argument("--num-prompts", type=_int(1), required=True)
    b.add_argument("--prompt-len", type=_int(1), default=128)
    b.add_argument("--shared-prefix-len", type=_int(0), default=0, metavar="TOKENS",
                   help="every prompt starts with the same this many tokens (a shared system prompt), then its "
                        "own --prompt-len")
    b.add_argument("--max-tokens", type=_int(1), required=True)
    b.add_argument("--burstiness", type=_float(0.0, low_open=True), default=1.0,
                   help="gamma shape of the gaps: 1 is Poisson, lower is burstier")
    b.add_argument("--max-concurrency", type=_int(1), default=None)
    b.add_argument("--processes", type=_int(1), default=1,
                   help="client processes sharing the requests (one Python client saturates at a few thousand "
                        "chunks per second; each rate prints the client's CPU share)")
    b.add_argument("--slo", type=_slo, default={}, help="latency targets for goodput, e.g. ttft=500,tpot=50 (ms)")
    b.add_argument("--temperature", type=_float(0.0, 2.0), default=0.0)
    b.add_argument("--seed", type=_int(0), default=0)
    b.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    b.add_argument("--token-prompts", action="store_true", help="prompts as lists of exactly --prompt-len token ids")
    b.add_argument("--timeout", type=_float(0.0, low_open=True), default=600.0, help="seconds per request")
    b.add_argument("--warmup", action="store_true",
                   help="send every prompt once, all at once and untimed, before the first rate (what `bench "
                        "--warmup` does offline: the server's first-time costs, such as CUDA graph captures, "
                        "are then out of the numbers)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--out", required=True, help="folder for bench_serve.json and bench_serve.png")
    b.add_argument("--label", default=None, help="this run's name in the JSON and the figure (default: host:port)")
    b.set_defaults(func=bench_serve_cmd)
