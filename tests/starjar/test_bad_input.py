"""Bad input gets a clear error naming the field and the limit, never a traceback."""

import pytest

from controller.cli.main import main
from controller.colocated import colocated_engine, load_pair
from starjar.errors import InvalidArgument, ModelMismatch
from starjar.spec.sampling import SamplingParams


@pytest.mark.parametrize("kwargs,field,limit", [
    (dict(max_tokens=0), "max_tokens", "[1,"),
    (dict(max_tokens=-3), "max_tokens", "[1,"),
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=float("nan")), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_k=-1), "top_k", ">= 0"),
])
def test_sampling_params(kwargs, field, limit):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and limit in err.value.limit


def test_prompt_limits(models):
    engine = colocated_engine(models["llama"], None)
    ok = SamplingParams()
    with pytest.raises(InvalidArgument, match="prompt: must contain at least 1 token"):
        engine.add_request([], ok)
    with pytest.raises(InvalidArgument) as err:
        engine.add_request([5] * 600, ok)  # context is 512
    assert err.value.field == "prompt" and "at most 511 tokens" in err.value.limit
    with pytest.raises(InvalidArgument) as err:
        engine.add_request([5, models["llama"].vocab_size], ok)
    assert err.value.field == "prompt_token_ids" and f"[0, {models['llama'].vocab_size})" in err.value.limit
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        engine.add_request([5], SamplingParams(stop_token_ids=[10**6]))
    assert not engine.has_work()  # nothing half-admitted


def test_draft_with_another_tokenizer(model_dirs):
    with pytest.raises(ModelMismatch) as err:
        load_pair(model_dirs["llama"], model_dirs["other_tok"])
    assert err.value.field == "draft" and "tokenizer must equal the target's" in err.value.limit


def _cli(tmp_path, capsys, *extra, lines=('{"prompt": "hi"}',)):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc = main(["generate", "--prompts", str(src), "--out", str(tmp_path / "out.jsonl"), *extra])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("extra,lines,needle", [
    (["--max-tokens", "0"], None, "invalid max_tokens: must be in [1, 65536]"),
    (["--temperature", "-1"], None, "invalid temperature: must be >= 0"),
    (["--top-p", "2"], None, "invalid top_p: must be in (0, 1]"),
    (["--gamma", "-1"], None, "invalid --gamma: must be >= 0"),
    ([], ('{"prompt": ""}',), "invalid --prompts line 1: prompt: must not be empty"),
    ([], ('{"prompt": "ok"}', "{not json"), "invalid --prompts line 2: must be valid JSON"),
    ([], ('{"text": "x"}',), 'invalid --prompts line 1: must be an object with a string "prompt"'),
    ([], ("{\"prompt\": \"" + "word " * 400 + "\"}",), "invalid --prompts line 1: prompt: at most 511 tokens"),
])
def test_cli_errors_name_the_field(tmp_path, capsys, model_dirs, extra, lines, needle):
    rc, err = _cli(tmp_path, capsys, "--target", model_dirs["llama"], *extra,
                   lines=lines or ('{"prompt": "hi"}',))
    assert rc == 2 and needle in err and "Traceback" not in err


def test_cli_mismatched_draft(tmp_path, capsys, model_dirs):
    rc, err = _cli(tmp_path, capsys, "--target", model_dirs["llama"], "--draft", model_dirs["other_tok"])
    assert rc == 2 and "invalid draft: tokenizer must equal the target's" in err


def test_cli_missing_model_dir(tmp_path, capsys):
    rc, err = _cli(tmp_path, capsys, "--target", str(tmp_path / "nope"))
    assert rc == 2 and "invalid target: must be a local directory" in err


def test_cli_inputs_python_cannot_take_are_one_line_errors(tmp_path, capsys, model_dirs, monkeypatch):
    """Each of these was a traceback: a prompts file that is not UTF-8, a --out whose folder does not exist
    (found only after every generation had run), a --device torch cannot parse, ports past 65535, a keepalive
    too long for gRPC's milliseconds, and a port another server holds."""
    import socket
    import subprocess
    import sys

    import torch

    from controller.cli.main import main

    threads = torch.get_num_threads()
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'{"prompt": "caf\xe9"}\n')
    rc = main(["generate", "--target", model_dirs["llama"], "--prompts", str(src), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid --prompts: must be UTF-8 text" in err and "Traceback" not in err
    src.write_text('{"prompt": "hi"}\n')
    for out in (tmp_path / "no" / "such" / "o.jsonl", tmp_path):
        rc = main(["generate", "--target", model_dirs["llama"], "--prompts", str(src), "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and "invalid --out" in err and "Traceback" not in err, err
    rc = main(["generate", "--target", model_dirs["llama"], "--prompts", str(src), "--out", str(tmp_path / "o"),
               "--device", "gpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid device: must be cpu or cuda[:N]" in err, err
    for flags, needle in ((["--metrics-port", "70000"], "invalid --metrics-port"),
                          (["--port", "-2"], "invalid --port"),
                          (["--keepalive", "inf"], "invalid --keepalive")):
        rc = main(["serve", "draft", "--model", model_dirs["draft"], *flags])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and "Traceback" not in err, err
    with socket.socket() as held:  # a port in use: the draft server cannot listen on it
        held.bind(("127.0.0.1", 0))
        held.listen()
        # In a process of its own: a server start hands this process's threads to its compute thread.
        run = subprocess.run([sys.executable, "-c", "import sys; from controller.cli.main import main; sys.exit(main("
                              f"['serve', 'draft', '--model', {model_dirs['draft']!r}, '--host', '127.0.0.1', "
                              f"'--port', '{held.getsockname()[1]}']))"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "cannot listen on 127.0.0.1:" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert torch.get_num_threads() == threads  # nothing here took this process's threads from the next tests


@pytest.mark.parametrize("fields,flag", [
    ({"max_targets": 5000}, "--max-targets"),  # the draft server refused it inside its actor: a 15-minute wait
    ({"draft_server": {"max_batch_rounds": 0}}, "--max-batch-rounds"),
    ({"dtype": "fp17"}, "--dtype"),
    ({"auth_token": "short"}, "--auth-token"),  # every other token is held to 16 characters
])
def test_up_refuses_before_starting_anything(model_dirs, fields, flag):
    from controller.cluster.spec import DTYPE_NAMES, ClusterSpec
    from starjar.model.loading import DTYPES

    with pytest.raises(InvalidArgument, match=flag):
        ClusterSpec(model_dirs["llama"], model_dirs["draft"], **fields).validate()
    assert set(DTYPE_NAMES) == set(DTYPES)  # the spec's list is the loader's
    ClusterSpec(model_dirs["llama"], model_dirs["draft"], dtype="bf16", max_targets=4096,
                auth_token="x" * 16).validate()


def test_the_spec_file_holding_the_tokens_is_owner_only_from_its_creation(model_dirs, tmp_path, monkeypatch):
    """It was written world-readable (umask 022) and narrowed after: a reader in between kept its file open."""
    import os
    import stat

    from controller.cluster import local as local_cluster
    from controller.cluster.spec import ClusterSpec

    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    modes = []

    def popen(*a, **k):  # the keeper would start here: look at the file it would read, then stop
        modes.append(stat.S_IMODE(os.stat(local_cluster.run_dir() / "spec.json").st_mode))
        raise RuntimeError("stop here")
    monkeypatch.setattr(local_cluster.subprocess, "Popen", popen)
    monkeypatch.setattr(local_cluster.os, "chmod", lambda *a, **k: None)  # no narrowing after the fact counts
    spec = ClusterSpec(model_dirs["llama"], model_dirs["draft"], auth_token="t" * 32).validate()
    for _ in range(2):  # a second start replaces the file the first left
        with pytest.raises(RuntimeError, match="stop here"):
            local_cluster.start_local(spec)
    assert modes == [0o600, 0o600]
