"""fn(*args) in a daemon thread of the job's driver (ray_jobs.run, ray_jobs.evaluate)."""

from __future__ import annotations


class Background:
    """fn(*args) in a daemon thread of the driver; result() joins it and returns its value or raises
    its error. Daemon: a job that stops (the doctor failed) does not wait for it."""

    def __init__(self, fn, *args):
        import threading

        self._out: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="job-background", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by result() in the driver's thread
            self._out["error"] = e

    def result(self):
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]
