"""Native builds under a lock that dies with its holder: a build stopped midway leaves torch's lock file
behind, and the next load must clear it instead of waiting on it forever."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler here: nothing is built")

LOAD = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from starjar.cpu import native_build
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    ok, why = native_build.load("starjar_build_probe", [Path(sys.argv[1])])
    print("loaded" if ok else "failed: " + why)
""")


def _load(src, native_dir, timeout=180):
    env = {**os.environ, "STARJAR_NATIVE_DIR": str(native_dir)}
    return subprocess.run([sys.executable, "-c", LOAD, str(src)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_lock_left_by_a_build_stopped_midway_is_cleared_not_waited_on(tmp_path):
    src = tmp_path / "probe.cpp"
    src.write_text('extern "C" int starjar_build_probe() { return 7; }\n')
    native = tmp_path / "native"
    first = _load(src, native)
    assert first.stdout.strip() == "loaded", first.stderr
    [build] = [d for d in native.iterdir() if d.is_dir()]
    (build / "lock").touch()  # as a build killed between its compile and its link leaves it
    try:
        second = _load(src, native, timeout=120)  # before: waited on the file forever
    except subprocess.TimeoutExpired:
        pytest.fail("the load waited on a stale build lock")
    assert second.stdout.strip() == "loaded", second.stderr
    assert "stopped midway" in second.stderr and not (build / "lock").exists()
