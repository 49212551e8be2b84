"""The host side of continuous batching: who runs in the next step and the tensors it needs.

Nothing here launches device work; the runner (one layer up) does. Below it: the device layer only
(the IO slots' buffers come from a device).

    requests.py     a request and its life cycle: WAITING -> PREFILLING -> DECODING -> FINISHED   01
    kv_cache.py     the paged KV cache and its block allocator                                    01
    scheduler.py    plans each step under a token budget; chunked prefill, mixed batches           01
    batch.py        a plan flattened into the step's host tensors                                  01
    decode_keys.py  the key list of decode rows, kept from step to step                            01
    sampling.py     greedy, temperature, top-k, top-p, seeded per request                          01
    buckets.py      the sizes steps are padded to (few shapes for graphs and compiles)             04
    slots.py        IO slots: host and device buffers of one step, and their events                04
    carry_over.py   where batch N's sampled tokens go in batch N+1 (placeholders + mask)          05
"""
