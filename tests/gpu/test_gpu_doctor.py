"""On the GPU: the doctor's GPU hygiene names a process that holds GPU memory and says how to
stop it, and stops naming it once it is gone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu


def test_doctor_names_a_process_holding_gpu_memory():
    from eagle3.doctor import check_gpus

    code = ("import time, torch; x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('up', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "up\n", "the holder process did not allocate GPU memory"
        rows = check_gpus()
        named = [r for r in rows if f"pid {holder.pid}: " in r.detail]
        assert len(named) == 1, [r.to_dict() for r in rows]
        row = named[0]
        assert not row.ok, row.to_dict()
        assert f"pid {holder.pid}: '{sys.executable} -c import time, torch;" in row.detail, row.detail
        assert f"`kill {holder.pid}`" in row.fix, row.fix
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 30
    while any(f"pid {holder.pid}: " in r.detail for r in check_gpus()):
        assert time.monotonic() < deadline, "nvidia-smi still lists the killed holder after 30 s"
        time.sleep(1)
