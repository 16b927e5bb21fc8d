"""The OpenMP spin starjar sets for processes that take turns on the same cores."""

import os

from controller.cluster import omp_env


def test_the_spin_follows_the_cpu_vendor_and_yields_to_the_users_choice(tmp_path, monkeypatch):
    intel, amd = tmp_path / "intel", tmp_path / "amd"
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\n")
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")
    assert omp_env.spin_count(str(intel)) == omp_env.SPIN_COUNT_INTEL != omp_env.SPIN_COUNT
    assert omp_env.spin_count(str(amd)) == omp_env.SPIN_COUNT
    assert omp_env.spin_count(str(tmp_path / "missing")) == omp_env.SPIN_COUNT
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    omp_env.share_cores()
    assert os.environ["GOMP_SPINCOUNT"] == omp_env.spin_count()
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    omp_env.share_cores()
    assert os.environ["GOMP_SPINCOUNT"] == "123"  # the user's own setting stays
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    omp_env.share_cores()
    assert "GOMP_SPINCOUNT" not in os.environ
