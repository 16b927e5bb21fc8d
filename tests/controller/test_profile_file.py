"""`starjar profile`'s file (controller/profiler.profile_to_file) on tiny models: the latency tables and the
machine they belong to, and the planners still load it."""

import json

import torch

from controller.tuning.profiler import profile_to_file
from starjar.spec.policies import load_policy


def test_profile_file_names_its_machine_and_still_loads(model_dirs, tmp_path):
    out = tmp_path / "profile.json"
    profile_to_file(model_dirs["llama"], model_dirs["draft"], str(out), quick=True)
    written = json.loads(out.read_text())
    meta = written["meta"]
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert meta["cpu_model"] and meta["torch"] == torch.__version__
    assert meta["quick"] is True and meta["command"] == "starjar profile" and meta["wall_s"] > 0
    assert {"cswitch", "t_of_n", "d0_s", "step_s"} <= set(written)
    for name in ("nightjar", "tide"):
        assert load_policy(name, 3, str(out)) is not None
