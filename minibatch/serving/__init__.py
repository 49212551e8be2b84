"""Serving: requests that arrive while the engine runs, the engine behind HTTP, and a benchmark that
talks to it as clients do (notebook 08). A plug-in: it imports the core, the core never imports it.

| module | what it is |
|---|---|
| `service.py` | `Serving(engine)`: one run sized for requests not known in advance, held while a `with` block lasts; `submit`, `generate`, `stats` from any thread |
| `loop.py` | `ServingLoop`: the thread that steps that run, takes what arrived at each step boundary and delivers tokens as a step applies them |
| `stream.py` | `TokenStream`: one request's tokens as they are made, read from any thread or from asyncio |
| `protocol.py` | the OpenAI requests: bodies as pydantic models (errors name the parameter; `sampling()` makes the request's SamplingParams), the chat prompt |
| `chat.py` | chat messages as the wire carries them (a role, text or text parts) and `plain`, the dicts a chat template takes |
| `guard.py` | what the server checks first: api key, JSON content type, Host header, body size and time; the engine's health; `ServeOptions` |
| `handlers.py` | one request's way: its body parsed, its prompts tokenized and submitted (a stream per choice: prompt lists, `n`), its answer whole or as server-sent events; `/tokenize`, `/detokenize`; `ServerState` |
| `metrics.py` | `GET /metrics`: requests, tokens, TTFT / ITL / end-to-end histograms, running, waiting, KV blocks (prometheus_client) |
| `replies.py` | the OpenAI answers: a whole response, stream chunks (text, role, usage), finish reasons |
| `server.py` | `python -m minibatch serve`: FastAPI + uvicorn over `Serving.submit`; completions and chat, streamed as server-sent events; `/v1/models`, `/health` |
| `startup.py` | what the server does before it is ready: warm-up requests, start-up graph progress, a frozen heap |
| `diagnostics.py` | where a serving run's time went: its timeline's busy periods (`bursts`), what each held (`window`), full garbage collections as spans (`gc_pauses`) |
| `bench_serve.py` | `python -m minibatch bench-serve`: the official `openai` async client against any OpenAI-compatible URL, Poisson arrivals at each rate |
| `bench_report.py` | what bench-serve reports: TTFT, TPOT, ITL, end-to-end latency percentiles, throughput, goodput; JSON merged by label; the figure |

FastAPI and uvicorn come with the `serve` extra (`pip install -e ".[serve]"`); the benchmark needs `openai`.
"""
