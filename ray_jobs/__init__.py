"""Drivers: parse config, create placement groups, start actors, wire object refs, report.
No module here imports vllm, torch or deepspeed at import time (tests/test_lazy_imports.py)."""
