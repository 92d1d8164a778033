"""A pdserve cluster on one Linux machine, for tests and benchmarks: simulated hosts in
namespaces on a bridge (netns.py), with Redis, a gateway and the worker pools on them, started
with the real CLI (stack.py). Needs root."""
