"""`cortex bench`: Cortex beside SGLang's and vLLM's routers, round-robin and an oracle, on simulated workers.

Modules: `workloads` (what is sent), `launch` (processes on loopback), `oracle` (the ceiling router),
`contestants` (who is measured), `client` (sending and recording), `metrics` (the figures), `runner` (one
run), `report` (tables, goals, plots), `cli` (the command). docs/benchmarks.md has the method and results.
"""
