#!/bin/bash
# The last carry call of this plan (README.md, "How to run it"): it carries .gpugq24 (make_carry.sh: the 25th GGUF
# part and the wheels) and starts queue.sh through ../last_call.sh.
#   BUDGET=<the last reply's lease.budget_left_s> bash benchmarks/results/leases/session30-plan/last.sh
exec bash benchmarks/results/leases/last_call.sh .gpugq24 qwen.gguf \
  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 benchmarks/results/leases/session30-plan/queue.sh
