"""One run sized for requests not known in advance, served while a `with` block lasts (notebook 08).

    with Engine(model) as engine, Serving(engine, "async", max_batch_size=8) as server:
        stream = server.submit("The for statement", max_new_tokens=48)   # from any thread, at any time
        for chunk in stream:
            print(chunk.text, end="")

`Serving` is what a caller holds: it takes the engine for as long as the block lasts
(`engine.exclusive`), sizes and opens the run (`serving_config`, `engine.open_run`), and hands every
request to the `ServingLoop` (loop.py) that steps it from a thread of its own; loop.py says what a
turn of that loop does and what running one step ahead changes online.
"""
from __future__ import annotations

from ..core.checks import check_prompts
from ..core.config import EngineConfig, serving_config, split_options, with_options
from ..core.requests import Request, SamplingParams
from ..core.timeline import Timeline
from .loop import TIMELINE_LIMIT, ServingLoop
from .stream import TokenStream


class Serving:
    """Serve requests submitted while a `with` block lasts, from a loop in a background thread.

    The run is sized once, for `max_batch_size` requests (default 8) of the model's whole context
    (or `num_blocks` KV blocks), and checked against free memory as the Serving is made; its KV
    cache, IO slots and CUDA graphs serve every request. `config` and `options` are generate's run
    options (EngineConfig), except that CUDA graphs default to decode steps only (serving_config
    says why). The loop is `mode` if given, else `config.mode` if a config is given, else "async".
    `max_queue` bounds the requests waiting for a seat (submit raises QueueFull beyond it).
    `capture_up_to` (tokens; 0: off) captures, as the block is entered and before any request, the
    CUDA graphs of requests up to that many tokens (speed/startup_graphs.py: no capture on a request's
    path; a GPU run with CUDA graphs only): decode steps', and with cuda_graphs=True every flat step's
    too, on coarser buckets; a `capture_progress(done, total)` set on the Serving before the block is
    entered is called after each (a minute or more for an 8B model). Bad options raise as the Serving
    is made; the run is sized and checked against free memory as the block is entered. Leaving the
    block ends every open stream ("cancelled") and joins the thread.
    """

    def __init__(self, engine, mode: str | None = None, config: EngineConfig | None = None, *,
                 max_queue: int | None = None, timeline: Timeline | None = None, capture_up_to: int = 0,
                 **options) -> None:
        mode = mode or (config.mode if config is not None else "async")
        if not isinstance(capture_up_to, int) or isinstance(capture_up_to, bool) or capture_up_to < 0:
            raise ValueError(f"capture_up_to must be a number of tokens >= 0 (0: off), got {capture_up_to!r}")
        self.engine, self.max_queue, self.capture_up_to = engine, max_queue, capture_up_to
        self.capture_progress = None  # set before the block is entered: called (done, total) after each capture
        self.startup_captures = 0
        self.config = with_options(EngineConfig, config, {**options, "mode": mode}, "Serving()")
        if capture_up_to:
            from ..speed.startup_graphs import check_capture
            check_capture(engine.model.device, self.config.cuda_graphs, self.config.compile)
        self.timeline = timeline if timeline is not None else Timeline(limit=TIMELINE_LIMIT)
        self.loop: ServingLoop | None = None
        self._hold = None

    def __enter__(self) -> "Serving":
        hold = self.engine.exclusive()
        hold.__enter__()
        try:  # sized now, with the engine held: its kept resources and the free memory as they are
            run_config = serving_config(self.engine.model, self.config, self.engine.kept_bytes)
            run = self.engine.open_run(run_config, [], self.timeline)
            if self.capture_up_to:
                from ..speed.startup_graphs import capture_startup_graphs
                self.startup_captures = capture_startup_graphs(self.engine, self.capture_up_to, self.capture_progress)
            self.loop = ServingLoop(self.engine, run, self.max_queue)
            self.loop.start_thread()
        except BaseException:
            if self.engine.run is not None:  # (opened, then the captures failed)
                self.engine.abandon()
            hold.__exit__(None, None, None)
            raise
        self._hold = hold
        return self

    def __exit__(self, *exc) -> None:
        loop, self.loop = self.loop, None
        try:
            loop.close()
            if loop.error is None:
                self.engine.finish()
            else:
                self.engine.abandon()
        finally:
            loop.run.on_step = None  # (the run and the loop hold each other: let the run go as soon as it ends)
            hold, self._hold = self._hold, None
            hold.__exit__(None, None, None)

    def submit(self, prompt, params: SamplingParams | None = None, **options) -> TokenStream:
        """Hand one request to the serving loop, from any thread; returns its TokenStream at once.

        `params` (a SamplingParams) and `options` (its fields by name) mean what they mean in
        `generate`: a request submitted with seed S gives the tokens `generate([prompt], seed=S)`
        gives; `stop` strings end it when its text contains one (the text ends before it). A request
        that could never fit in the KV cache is refused here.
        """
        loop = self.loop
        if loop is None:
            raise RuntimeError("submit needs a serving engine: `with Serving(engine) as server: server.submit(...)`")
        model = self.engine.model
        params = with_options(SamplingParams, params, options, "submit()")
        (ids,), params = check_prompts(model, [prompt], params)
        request = Request(next(loop.rids), ids, params)
        allocator = loop.run.scheduler.allocator
        if allocator.blocks_for(request.max_len) > allocator.num_blocks:
            raise ValueError(f"this request needs {request.max_len} tokens of KV cache but the serving cache holds "
                             f"{allocator.num_blocks * allocator.block_size}: it could never run (raise num_blocks)")
        return loop.submit(request, TokenStream(request.rid, len(ids)), model.tokenizer)

    def generate(self, prompts, params: SamplingParams | None = None, **options) -> list[list[int]]:
        """`Engine.generate` for callers of a serving engine: each prompt submitted (prompt i seeded
        seed + i), the new tokens of each returned in order; any thread may call it at once."""
        params, config = split_options(params, None, options, "generate()")
        if "mode" in options and config.mode != self.config.mode:
            raise ValueError(f"this engine is serving in {self.config.mode!r} mode; generate(mode={config.mode!r}) "
                             "cannot run beside it (leave the Serving block first, or use its mode)")
        token_ids, params = check_prompts(self.engine.model, prompts, params)
        streams = [self.submit(p, params.replace(seed=params.seed + i)) for i, p in enumerate(token_ids)]
        return [s.wait().token_ids for s in streams]

    def stats(self) -> dict:
        """The serving run's KV blocks, requests, steps and CUDA graph captures so far (a snapshot, read
        without stopping the loop). Free KV blocks count the prefix cache's idle ones (`kv_blocks_cached`
        are all it keeps, held or idle); `prefix_cache_hit_tokens` of `prefix_cache_prompt_tokens` came
        from it. A graph is captured the first time a step shape comes up: captures
        that keep growing under load are steps that ran slower than a replay would, and
        `graph_capture_s` is the host time they held the loop (warm-up step, drain, capture; with
        compile=True also the torch.compile of a new shape, which happens in the warm-up step);
        `startup_graph_captures` of them were made before the first request (capture_up_to).
        `loop_cpu_s`: the CPU seconds the loop's thread has run (a server's HTTP thread shares the
        interpreter's lock with it: together they tell how much of it was left)."""
        loop = self.loop
        if loop is None:
            return {"serving": False}
        run = loop.run
        s = run.scheduler
        prefix = s.prefix
        return {"serving": True, "mode": run.mode, "kv_blocks": s.allocator.num_blocks,
                "kv_blocks_free": s.num_free_blocks, "running": len(s.running),
                "kv_blocks_cached": prefix.num_kept, "prefix_cache_hit_tokens": prefix.hit_tokens,
                "prefix_cache_prompt_tokens": prefix.prompt_tokens,
                "waiting": len(s.waiting) + len(loop.inbox), "steps": s.step,
                "graph_captures": len(run.runner.captures), "startup_graph_captures": self.startup_captures,
                "graph_capture_s": round(sum(c["seconds"] for c in run.runner.captures), 3),
                "loop_cpu_s": round(loop.cpu_s, 3)}
