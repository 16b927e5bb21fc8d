"""deploy/: the `ray up` cluster files pass Ray's own config validation, and every key says what it is for."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "ray"
FILES = ["cluster-local.yaml", "cluster-aws.yaml"]


@pytest.mark.parametrize("name", FILES)
def test_cluster_file_passes_rays_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / name).read_text())
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` does first: defaults merged in
    validate_config(prepared)  # then the JSON schema and Ray's own consistency checks
    starts = " ".join(prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"])
    resources = {k for t in prepared["available_node_types"].values() for k in t.get("resources", {})}
    for custom in ("starjar_draft", "starjar_target"):
        assert custom in starts or custom in resources, f"{custom} is offered by no node"
    setup = " ".join(prepared["setup_commands"])
    assert "starjar" in setup and "torch==2.13.0" in setup and ".profile" in setup


def test_a_broken_cluster_file_is_rejected():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "cluster-aws.yaml").read_text())
    config["head_node_type"] = "no-such-type"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("name", FILES)
def test_every_key_is_commented(name):
    lines = (DEPLOY / name).read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        if re.match(r'^\s*(- )?["\w~.-]+:', line) and "#" not in line:
            prev = next((p for p in reversed(lines[:i]) if p.strip()), "")
            if not prev.strip().startswith("#"):
                missing.append(f"{i + 1}: {line.strip()}")
    assert not missing, missing
