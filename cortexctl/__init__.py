"""The `cortex` command (cli.py) and what it runs: the supervisor of a replica's processes (supervisor.py),
`cortex run` (gateway.py) and `cortex demo` (demo.py). The top application layer (docs/architecture.md "Layers"):
it may import everything below it and nothing imports it.
"""
