"""Prints `export` lines that hand pip's configuration to uv (scripts/install_cpu.sh).

uv reads no pip.conf and no PIP_* variables. A machine whose pip is pointed at local indexes,
wheel folders, constraints or a CA file would get other packages from uv, or none. So the
settings `pip config list` shows are mapped to uv's own variables; the highest of pip's
configuration levels wins, as in pip. uv's index strategy is set to pip's (the best version
across every index, not the first index that has the package)."""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's levels, lowest first (pip config list prints each key once per level it is set in)
LEVELS = ("global", "user", "site", ":env:")
# pip's setting -> (uv's variable, how uv separates several values)
UV_VARS = {"index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
           "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " "), "cert": ("SSL_CERT_FILE", " ")}


def uv_env(pip_config_list: str) -> dict[str, str]:
    """uv's variables for the settings in `pip config list`'s output (lines `level.key='value'`)."""
    found: dict[str, tuple[int, str]] = {}
    for line in pip_config_list.splitlines():
        name, sep, value = line.partition("=")
        level, _, key = name.rpartition(".")
        if not sep or key not in UV_VARS or level not in LEVELS:
            continue
        rank = LEVELS.index(level)
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, ast.literal_eval(value))
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    for key, (_, value) in found.items():
        var, sep = UV_VARS[key]
        env[var] = sep.join(value.split())
    return env


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in uv_env(listed).items()))
