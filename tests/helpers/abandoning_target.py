"""A target that attaches to a draft server, drafts a few rounds, prints "ready" and waits to be killed.

Used by the leak tests: the process is SIGKILLed mid-session, so it never detaches.
Usage: python abandoning_target.py HOST:PORT VOCAB:HASH SEQUENCES
"""

import os
import sys
import threading

import grpc

from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc


def main() -> None:
    address, fp, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    vocab, tok_hash = fp.split(":", 1)
    ch = grpc.insecure_channel(address)
    stub = pb_grpc.DraftServiceStub(ch)
    # Each process is a target of its own: one worker id each (a live id is not handed to a second process).
    tag = stub.Attach(pb.AttachRequest(worker_id=f"abandoner-{os.getpid()}", fingerprint=pb.ModelFingerprint(
        vocab_size=int(vocab), tokenizer_hash=tok_hash)), timeout=30).tag
    rounds = [pb.SpeculateRequest(round_id=r + 1, sequences=[
        pb.SequenceRound(seq_id=s + 1, start=0, tokens=[5 + (s + r + i) % 200 for i in range(64)], gamma=4)
        for s in range(n)]) for r in range(3)]
    def requests():
        yield from rounds
        threading.Event().wait()  # the stream stays open, sending nothing more

    replies = stub.Speculate(requests(), metadata=(("starjar-tag", tag.hex()),))
    for _ in range(3):
        next(replies)
    print("ready", flush=True)
    sys.stdin.read()  # hold the session open until killed


if __name__ == "__main__":
    main()
