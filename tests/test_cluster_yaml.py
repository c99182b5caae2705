"""cluster.yaml is a config Ray's own cluster launcher accepts (its validator, no machines)."""

import yaml

from tests.conftest import REPO


def test_cluster_yaml_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(yaml.safe_load((REPO / "cluster.yaml").read_text()))
    validate_config(cfg)
    assert cfg["provider"]["type"] == "local" and len(cfg["provider"]["worker_ips"]) == cfg["max_workers"]
    assert any("--num-gpus=8" in c for c in cfg["worker_start_ray_commands"])
    assert any("--head" in c and "--num-gpus=0" in c for c in cfg["head_start_ray_commands"])
