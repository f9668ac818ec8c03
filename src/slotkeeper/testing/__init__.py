"""What the demo, the tests and the benchmarks run slotkeeper with: tiny random-weight models and a vision
projector (tinymodel and its parts), the real Gemma 3 270M (realmodel), slotkeeper and plain llama-server as
processes (harness), agent sessions over the three APIs (agents) and an S3 server (s3server).

The stub llama-server for faults is no part of the install: it lives with the tests (tests/stub.py)."""
