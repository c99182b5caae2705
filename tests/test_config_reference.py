"""docs/config.md is what eagle3.config_reference generates from the config dataclasses, and every
config field carries the docstring the page shows."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from eagle3.config import JobConfig
from eagle3.config_reference import _sections, field_docs, reference

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_the_generated_reference():
    """If this fails, a config field changed: run `python -m eagle3.config_reference > docs/config.md`."""
    assert (ROOT / "docs" / "config.md").read_text() == reference()


def test_every_config_field_has_a_docstring():
    missing = []
    for where, cls in _sections(JobConfig, ""):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            hint_is_section = dataclasses.is_dataclass(f.type) or (
                isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory))
            if not hint_is_section and f.name not in docs:
                missing.append(f"{where}.{f.name}" if where else f.name)
    assert missing == [], f"config fields without a docstring under them: {missing}"


def test_reference_lists_nested_sections_with_dotted_keys():
    text = reference()
    assert "## `train.optimizer`" in text
    assert "| `train.optimizer.lr` |" in text
    assert "| `extract.hs_dtype` |" in text


def test_help_config_flag_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "ray_jobs.run", "--help-config"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out == reference()
