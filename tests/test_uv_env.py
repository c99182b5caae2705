"""scripts/uv_env.py: pip's configuration handed to uv, which reads none of it (scripts/install_cpu.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "uv_env.py"
spec = importlib.util.spec_from_file_location("uv_env", SCRIPT)
uv_env_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_env_module)
uv_env = uv_env_module.uv_env


def test_pip_settings_become_uvs_with_its_separators():
    listed = ("global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
              "global.constraint='/etc/xdg/pip/constraints.txt'\n"
              "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
              "global.find-links='/opt/wheels /srv/more'\n"
              "global.default-timeout='180'\n")
    assert uv_env(listed) == {
        "UV_INDEX_STRATEGY": "unsafe-best-match",
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
        "UV_CONSTRAINT": "/etc/xdg/pip/constraints.txt",
        "UV_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "UV_FIND_LINKS": "/opt/wheels,/srv/more",  # uv separates these with commas
    }


def test_the_highest_level_wins_as_in_pip():
    # PIP_FIND_LINKS (':env:') over the user's file over the global one, whatever order pip lists them in
    listed = (":env:.find-links='/env'\nglobal.find-links='/global'\nuser.find-links='/user'\n"
              "user.index-url='https://u/simple'\n")
    env = uv_env(listed)
    assert env["UV_FIND_LINKS"] == "/env" and env["UV_INDEX_URL"] == "https://u/simple"


def test_no_configuration_gives_pips_index_strategy_only():
    assert uv_env("") == {"UV_INDEX_STRATEGY": "unsafe-best-match"}
