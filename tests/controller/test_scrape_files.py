"""The files Prometheus reads (controller.cluster.metrics): the endpoints and the token, this user's alone."""

import json
import os

from controller.cluster.metrics import SCRAPE_TOKEN_FILE, write_file_sd, write_scrape_token


def test_scrape_files_are_this_users_alone_whatever_the_umask(tmp_path):
    sd = tmp_path / "sd" / "prometheus_sd.json"
    before = os.umask(0o022)  # a permissive umask, as a shell's default
    try:
        write_file_sd(str(sd), {"front_end": "10.0.0.5:9100", "target_worker:w0": "10.0.0.6:9101"})
        write_scrape_token(str(sd), "t" * 40)
        sd.chmod(0o644)  # a file left readable by an earlier writer is replaced by one that is not
        write_file_sd(str(sd), {"front_end": "10.0.0.5:9100"})
    finally:
        os.umask(before)
    for path in (sd, sd.with_name(SCRAPE_TOKEN_FILE)):
        assert oct(path.stat().st_mode & 0o777) == "0o600", path
    assert json.loads(sd.read_text()) == [{"targets": ["10.0.0.5:9100"], "labels": {"component": "front_end"}}]
    assert not list(sd.parent.glob("*.tmp"))
