"""Serving: the engine behind HTTP, and a benchmark that talks to it as clients do (notebook 08).

| module | what it is |
|---|---|
| `protocol.py` | the OpenAI wire format: request bodies checked by hand (errors name the parameter), response bodies, stream chunks, the chat prompt |
| `server.py` | `python -m minibatch serve`: FastAPI + uvicorn over `engine.submit`; completions and chat, streamed as server-sent events; `/v1/models`, `/health` |
| `bench_serve.py` | `python -m minibatch bench-serve`: the official `openai` async client against any OpenAI-compatible URL, Poisson arrivals at each rate |
| `bench_report.py` | what bench-serve reports: TTFT, TPOT, ITL, end-to-end latency percentiles, throughput, goodput; JSON merged by label; the figure |

FastAPI and uvicorn come with the `serve` extra (`pip install -e ".[serve]"`); the benchmark needs `openai`.
"""
