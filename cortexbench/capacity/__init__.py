"""`cortex capacity`: how many requests a worker holds (KV memory from the model's config) and where its
latency knee is (a bounded load test); both turned into a `max_concurrent` by the 80 %-of-knee rule.

`kv_size.py` (config.json -> KV bytes per token per layer), `budget.py` (GPU memory -> tokens, concurrent
requests), `knee.py` (the knee of a concurrency sweep, the 80 % rule), `probe.py` (the load test), `cli.py`.
"""
