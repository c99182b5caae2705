#!/bin/bash
# The last carry call of this plan (README.md): it carries .gpusm02 (../session32-plan/make_carry.sh: the third GGUF
# part and the wheels) and starts queue.sh through ../last_call.sh.
#   BUDGET=<the last reply's lease.budget_left_s> bash benchmarks/results/leases/session34-layers-plan/last.sh
exec bash benchmarks/results/leases/last_call.sh .gpusm02 smollm2.gguf \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 benchmarks/results/leases/session34-layers-plan/queue.sh
