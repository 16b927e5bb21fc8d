"""Generated gRPC stubs for the starjar.v1 wire contract (see proto/ and scripts/gen_proto.py)."""
