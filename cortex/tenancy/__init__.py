"""Tenancy state shared by a replica's processes: the limits' pure rules (limits.py) and the board that holds
each tenant's counters across extproc processes and the observer (board.py). docs/tenancy.md."""
