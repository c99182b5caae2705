"""benchmarks/cpu_by_process.py: the kinds it groups processes by, and a sampled run."""

from __future__ import annotations

import os
import sys

from benchmarks.cpu_by_process import kind, sample


def test_kinds_group_ray_workers_by_actor_and_python_by_module():
    assert kind(["ray::EvaluatorActor.measure_started"]) == "ray::EvaluatorActor"
    assert kind(["ray::RayTrainWorker"]) == "ray::RayTrainWorker"
    assert kind(["/v/bin/python", "-m", "ray_jobs.run", "--config", "x.yaml"]) == "python -m ray_jobs.run"
    assert kind(["/v/bin/python", "-u", "/v/ray/_private/log_monitor.py", "--session-dir=x"]) == "python log_monitor.py"
    assert kind(["/v/bin/python", "-B", "-c", "from multiprocessing.forkserver import main; main(25)"]) == \
        "ray dashboard head modules"
    assert kind(["ray-dashboard-MetricsHead-0 (/v/bin/python -B -c ...)"]) == "ray dashboard head modules"
    assert kind(["[pytest-xdist running] tests/test_e2e.py::test_x"]) == "pytest worker (the tests' own code)"
    # the same worker before it set its title: execnet's bootstrap
    assert kind(["/v/bin/python", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == \
        "pytest worker (the tests' own code)"
    assert kind(["/usr/bin/raylet", "--node_ip_address=x"]) == "raylet"
    # a `python -c` child by its code's first 50 characters, whitespace collapsed
    assert kind(["/v/bin/python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                 "--multiprocessing-fork"]) == "python -c from multiprocessing.spawn import spawn_main; spaw"
    assert kind(["/v/bin/python", "-c", "\nimport sys\n\nimport   ray\n"]) == "python -c import sys import ray"


def test_a_busy_child_is_sampled_under_its_kind(tmp_path):
    # a script of its own name: the sampler sees every process of the machine (another test's `python -c`)
    busy = tmp_path / f"busy_{os.getpid()}.py"
    busy.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n")
    result = sample([sys.executable, str(busy)], every=0.05)
    assert result["returncode"] == 0 and result["command"][-1] == str(busy)
    cpu = {name: (n, s) for name, n, s in result["by_kind"]}
    assert cpu[f"python {busy.name}"][0] == 1  # one process of that kind was seen, and it used the CPU
    assert cpu[f"python {busy.name}"][1] > 0 and result["sampled_cpu_s"] > 0
