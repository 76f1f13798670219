"""`cortex sim`: a simulated vLLM or SGLang worker (OpenAI API, KV events, timing model; docs/simulator.md).

An application above the processes (docs/architecture.md "Layers"): it imports the core library, never extproc,
ingest or observe.
"""
