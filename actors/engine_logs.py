"""Where the engines' own log lines go inside Ray workers: the job's output is for the user.

vLLM logs each engine start at INFO, dozens of lines an engine (the demo starts seven: the
doctor's dry run, the extraction replica, one per num_speculative_tokens in eval), and Ray
forwards every worker's stdout and stderr to the job's output. `setup_worker` sends the `vllm`
logger's records to a file of the worker's own in Ray's session log directory,
`<temp dir>/<session>/logs/eagle3-engine-<pid>.log` (next to Ray's worker-*.out/err of the same
pid, and listed with them in the dashboard's Logs view), and only its warnings and errors to
the worker's stderr, which Ray still forwards: a warning as one line (vLLM attaches tracebacks
to some, e.g. a chat-template warm-up that cannot work without a tokenizer; the traceback stays
in the file), an error in full. Engine processes that vLLM spawns inherit the
same routing through the environment (VLLM_LOGGING_CONFIG_PATH, EAGLE3_ENGINE_LOG_DIR).

Installed by ray_jobs.cluster.init_ray as the job's `worker_process_setup_hook`, so it runs in
every actor and task before any of them imports vllm. `EAGLE3_ENGINE_LOGS=1` in the driver's
environment leaves it out: the engines then log to the job's output as they do by default.
Does not own: our own loggers (`eagle3.*`, `actors.*`), progress bars, or what engines print
without a logger (their weight-loading bars, C++ warnings).
DeepSpeed needs nothing here: its `DeepSpeed` logger is at WARNING since 0.17 (checked by
tests/test_engine_logs.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

SWITCH = "EAGLE3_ENGINE_LOGS"
"""Set to 1 in the driver's environment to see the engines' INFO lines in the job's output."""
LOG_DIR_ENV = "EAGLE3_ENGINE_LOG_DIR"
LOGGING_CONFIG_NAME = "eagle3-vllm-logging.json"
FORMAT = "%(levelname)s %(asctime)s pid=%(process)d [%(filename)s:%(lineno)d] %(message)s"
FORWARDED_FORMAT = "[vLLM] %(levelname)s %(message)s"  # Ray prefixes the actor and its pid


def vllm_logging_config() -> dict:
    """logging.dictConfig for vLLM's `vllm` logger: every record at VLLM_LOGGING_LEVEL (INFO by
    default) into this process's engine log file, warnings and errors also to stderr."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"eagle3_engine": {"format": FORMAT},
                       "eagle3_forwarded": {"()": "actors.engine_logs.ForwardedFormatter", "fmt": FORWARDED_FORMAT}},
        "handlers": {
            "eagle3_engine_file": {"()": "actors.engine_logs.engine_log_file", "level": level,
                                   "formatter": "eagle3_engine"},
            "eagle3_engine_stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                                     "level": "WARNING", "formatter": "eagle3_forwarded"},
        },
        "loggers": {"vllm": {"handlers": ["eagle3_engine_file", "eagle3_engine_stderr"], "level": level,
                             "propagate": False}},
    }


def engine_log_path() -> Path:
    return Path(os.environ[LOG_DIR_ENV]) / f"eagle3-engine-{os.getpid()}.log"


class ForwardedFormatter(logging.Formatter):
    """A warning in one line, its traceback left to the engine log file; an error in full."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno < logging.ERROR and (record.exc_info or record.exc_text or record.stack_info):
            record = logging.makeLogRecord({**record.__dict__, "msg": f"{record.getMessage()} (traceback in "
                                            f"{engine_log_path()})", "args": None, "exc_info": None,
                                            "exc_text": None, "stack_info": None})
        return super().format(record)


def engine_log_file() -> logging.Handler:
    """The handler vLLM's logging config names: this process's file in EAGLE3_ENGINE_LOG_DIR,
    created on the first record (a worker that starts no engine leaves no file)."""
    return logging.FileHandler(engine_log_path(), delay=True)


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: route vLLM's logging before anything imports vllm. A
    VLLM_LOGGING_CONFIG_PATH or VLLM_CONFIGURE_LOGGING=0 the user set is left as it is."""
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    import ray

    ctx = ray.get_runtime_context()
    log_dir = Path(ctx.get_temp_dir()) / ctx.get_session_name() / "logs"
    config = log_dir / LOGGING_CONFIG_NAME
    if not config.exists():
        # Every worker of the node writes the same text; the rename makes each write whole.
        tmp = log_dir / f".{LOGGING_CONFIG_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(vllm_logging_config(), indent=1))
        os.replace(tmp, config)
    os.environ[LOG_DIR_ENV] = str(log_dir)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
