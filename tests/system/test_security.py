"""Every port authenticated (the cluster token on every RPC, health open), TLS and mutual
TLS on the draft server and the target workers, and a draft session usable only by whoever attached it."""

import grpc
import pytest
from draft_stream import fingerprint
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import TOKEN, client_security

from draft_server.background import BackgroundDraftServer
from starjar.service.security import Security, read_token
from starjar.service.serving import BackgroundLoop
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from starjar.v1 import generate_pb2, generate_pb2_grpc
from target_worker.config import TargetWorkerConfig
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer
from target_worker.server import TargetServer


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_the_draft_server_requires_the_cluster_token_and_health_stays_open(models):
    with BackgroundDraftServer(models["draft"], security=Security(token=TOKEN)) as srv:
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        attach = pb.AttachRequest(worker_id="w", fingerprint=fingerprint(models["llama"]))
        assert _code(lambda: stub.Attach(attach)) == grpc.StatusCode.UNAUTHENTICATED
        bad = (("authorization", "Bearer " + "x" * len(TOKEN)),)
        assert _code(lambda: stub.Attach(attach, metadata=bad)) == grpc.StatusCode.UNAUTHENTICATED
        for call in (lambda: stub.GetStats(pb.GetStatsRequest()),
                     lambda: stub.Release(pb.ReleaseRequest(tag=b"x" * 16, detach=True))):
            assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
        assert len(srv.server.sessions) == 0  # before: anyone on the network took an N_max slot
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Attach(attach, metadata=(("authorization", f"Bearer {TOKEN}"),)).tag
        ch.close()


def test_a_target_with_the_token_speculates_and_one_without_decodes_alone(models, prompt_ids, reference):
    ref = reference("llama", 24)
    with BackgroundDraftServer(models["draft"], security=Security(token=TOKEN)) as srv:
        for security, drafts in ((Security(token=TOKEN), True), (Security(), False)):
            rp = RemoteProposer(srv.address, models["llama"].fingerprint, "t", deadline_s=2.0,
                                backoff_s=(0.02, 0.1), security=security)
            assert rp.wait_attached(3) == drafts
            eng = TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=4))
            out = [r.output_ids for r in eng.generate(prompt_ids[:8], SamplingParams(max_tokens=24))]
            assert out == ref[:8]
            assert (eng.stats.accepted_tokens > 0) == drafts
            if not drafts:
                assert rp.stats.refusals["unauthenticated"] >= 1
            rp.close()


def test_a_target_worker_requires_the_cluster_token(models):
    server = TargetServer(models["llama"], TargetWorkerConfig(worker_id="w"), security=Security(token=TOKEN))
    loop = BackgroundLoop("target-loop")
    loop.run(server.start())
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        req = generate_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                           sampling=generate_pb2.SamplingParams(max_tokens=4))
        assert _code(lambda: list(stub.Generate(req, timeout=30))) == grpc.StatusCode.UNAUTHENTICATED
        out = list(stub.Generate(req, timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),)))
        assert sum(len(r.token_ids) for r in out) == 4
        ch.close()
    finally:
        loop.run(server.stop())
        loop.stop()


def test_read_token_refuses_short_tokens(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text("short\n")
    with pytest.raises(Exception, match="at least 16"):
        read_token(str(f))
    f.write_text(TOKEN + "\n")
    assert read_token(str(f)) == TOKEN
    monkeypatch.delenv("STARJAR_AUTH_TOKEN", raising=False)
    assert read_token(None) is None


# ---- TLS ---------------------------------------------------------------------------------------------------

def test_mutual_tls_speculates_losslessly_and_binds_each_session_to_its_caller(models, pki, prompt_ids, reference):
    server_security = Security(token=TOKEN, tls_cert=pki["server.pem"], tls_key=pki["server.key"],
                               tls_client_ca=pki["ca.pem"])
    with BackgroundDraftServer(models["draft"], security=server_security) as srv:
        attach = pb.AttachRequest(worker_id="w", fingerprint=fingerprint(models["llama"]))
        # No client certificate: the handshake fails, nothing is attached.
        anonymous = client_security(pki, None)
        ch = anonymous.channel(srv.address)
        assert _code(lambda: pb_grpc.DraftServiceStub(ch).Attach(attach, metadata=anonymous.metadata(),
                                                                 timeout=5)) == grpc.StatusCode.UNAVAILABLE
        ch.close()
        # Plain text to a TLS port fails too.
        plain = grpc.insecure_channel(srv.address)
        assert _code(lambda: pb_grpc.DraftServiceStub(plain).Attach(attach, metadata=anonymous.metadata(),
                                                                    timeout=5)) == grpc.StatusCode.UNAVAILABLE
        plain.close()
        # Target A attaches; target B (another certificate, same CA, same token) cannot use A's tag.
        a, b = client_security(pki, "client_a"), client_security(pki, "client_b")
        ch_a, ch_b = a.channel(srv.address), b.channel(srv.address)
        tag = pb_grpc.DraftServiceStub(ch_a).Attach(attach, metadata=a.metadata(), timeout=5).tag
        stub_b = pb_grpc.DraftServiceStub(ch_b)
        assert _code(lambda: stub_b.Release(pb.ReleaseRequest(tag=tag, detach=True), metadata=b.metadata(),
                                            timeout=5)) == grpc.StatusCode.NOT_FOUND
        stream = stub_b.Speculate(iter([pb.SpeculateRequest(round_id=1, sequences=[
            pb.SequenceRound(seq_id=1, start=0, tokens=[5, 6], gamma=1)])]),
            metadata=(("starjar-tag", tag.hex()), *b.metadata()), timeout=5)
        assert _code(lambda: list(stream)) == grpc.StatusCode.NOT_FOUND
        assert len(srv.server.sessions) == 1  # A's session is untouched
        assert pb_grpc.DraftServiceStub(ch_a).Release(pb.ReleaseRequest(tag=tag, detach=True),
                                                      metadata=a.metadata(), timeout=5).released == 0
        ch_a.close()
        ch_b.close()
        # A whole target over mutual TLS: drafts flow, output is the target's own.
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "t", deadline_s=2.0, security=a)
        assert rp.wait_attached(10)
        eng = TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=4))
        out = [r.output_ids for r in eng.generate(prompt_ids[:8], SamplingParams(max_tokens=24))]
        assert out == reference("llama", 24)[:8] and eng.stats.accepted_tokens > 0
        rp.close()


def test_a_metrics_endpoint_with_a_token_answers_only_those_who_send_it():
    import urllib.error

    from starjar.service.metrics import new_registry, scrape, serve

    token = "t" * 40
    guarded = serve(new_registry("target_worker"), "127.0.0.1", 0, token=token)
    assert "starjar_build_info" in scrape(f"127.0.0.1:{guarded}", token)
    for wrong in (None, "u" * 40):
        with pytest.raises(urllib.error.HTTPError) as err:
            scrape(f"127.0.0.1:{guarded}", wrong)
        assert err.value.code == 401 and err.value.headers["WWW-Authenticate"].startswith("Bearer")
    open_port = serve(new_registry("target_worker"), "127.0.0.1", 0)  # no cluster token: open, as its gRPC port
    assert "starjar_build_info" in scrape(f"127.0.0.1:{open_port}")


def test_a_metrics_endpoint_serves_on_an_ipv6_host():
    import socket

    from starjar.service.metrics import new_registry, scrape, serve

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = serve(new_registry("draft_server"), "::1", 0, token="v" * 40)
    assert "starjar_build_info" in scrape(f"[::1]:{port}", "v" * 40)


def test_the_sdk_given_certificates_speaks_tls_and_never_sends_the_token_in_clear(models, pki):
    """Client(..., root_certificates=CA) without tls=True: before, the certificate was dropped and the token went
    out in plaintext metadata (the TLS worker refused the connection). Now certificates turn TLS on, and
    tls=False with certificates is refused before any connection."""
    from starjar import Client
    from starjar.errors import InvalidArgument

    security = Security(token=TOKEN, tls_cert=pki["server.pem"], tls_key=pki["server.key"])
    server = TargetServer(models["llama"], TargetWorkerConfig(worker_id="w"), security=security)
    loop = BackgroundLoop("tls-target")
    loop.run(server.start())
    ca = open(pki["ca.pem"], "rb").read()
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=30, auth_token=TOKEN, root_certificates=ca) as c:
            assert len(c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4).token_ids) == 4
        with pytest.raises(InvalidArgument, match="tls"):
            Client(f"127.0.0.1:{server.port}", auth_token=TOKEN, tls=False, root_certificates=ca)
    finally:
        loop.run(server.stop())
        loop.stop()


@pytest.mark.parametrize("kw,field", [(dict(max_tokens=0), "max_tokens"),
                                      (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
                                      (dict(stop_token_ids=[-1]), "stop_token_ids"),
                                      (dict(temperature="0.5"), "temperature"), (dict(tpot_slo_s="fast"), "tpot_slo_s"),
                                      (dict(seed=1.5), "seed")])
def test_the_sdk_refuses_bad_arguments_as_the_server_would(kw, field):
    """Checked before any connection (nothing listens at port 1), and raised as the InvalidRequest the README
    promises, naming the field: before, these were a ValueError or TypeError from protobuf naming nothing, and
    starjar.InvalidArgument for the rest."""
    from starjar import Client, ClientError, InvalidRequest

    with Client("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(InvalidRequest) as err:
            c.generate(None if "prompt_token_ids" in kw else "hi", **kw)
    assert isinstance(err.value, ClientError) and err.value.field == field, (err.value.field, str(err.value))
