"""The wire contract both sides import: metadata keys, refusal reasons, request codecs."""
