"""Measuring and the command line (notebook 07, README).

    bench.py   sync and async side by side in one process; transformers in a process of its own
    floors.py  the hardware's floor under a step, measured on this machine; pool memory of graphs
    online.py  Poisson arrivals at a serving engine: TTFT and inter-token latency, sync against async (08)
    cli.py     `python -m minibatch demo | bench`, and the parser of every subcommand
    cli_serving.py  `serve | bench-serve` (notebook 08)
    cli_args.py     the argument types they share
"""
