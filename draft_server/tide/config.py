"""Settings of online draft adaptation (TIDE): buffer, collection control, trainer. Plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from draft_server.tide.buffer import BufferConfig
from draft_server.tide.collect import CollectConfig
from starjar.errors import InvalidArgument


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8  # of the low-rank logit adapter (a per-token bias rides with it)
    chunk_tokens: int = 16  # tokens of a buffered sequence run through the draft per micro-step
    batch_positions: int = 32  # positions per gradient micro-step
    steps_per_cycle: int = 48  # gradient micro-steps per training cycle
    # Adam. 0.01 overfits: trained on the target's own outputs, a tiny draft's held-out agreement fell 0.96 -> 0.76
    # (0.95 at 0.003); on the target's first 12 layers 0.001 gained 0.04 -> 0.105 on translation with no harm to
    # the other categories, 0.003 0.04 -> 0.13 with some.
    lr: float = 0.001
    weight_decay: float = 1e-4
    min_new_positions: int = 256  # new training positions (from newly finished sequences) that start a cycle
    max_positions: int = 8192  # training positions held (a ring: the newest traffic wins)
    max_eval_positions: int = 1024  # held-out positions held (a ring)
    eval_every: int = 4  # every eval_every-th finished sequence is held out, never trained on
    # Held-out positions a cycle scores: the newest ones. Scoring the whole held-out ring judged an adapter on
    # the traffic before a domain switch: right after one it approved adapters for the old domain.
    eval_recent: int = 192
    eval_chunk: int = 16  # held-out positions scored per micro-step
    seed: int = 0

    def __post_init__(self) -> None:
        for name, lo, hi in (("rank", 1, 256), ("chunk_tokens", 1, 512), ("batch_positions", 1, 4096),
                             ("steps_per_cycle", 1, 100_000),
                             ("min_new_positions", 1, 1 << 20), ("max_positions", 16, 1 << 22),
                             ("max_eval_positions", 16, 1 << 22), ("eval_every", 2, 1000), ("eval_chunk", 1, 4096),
                             ("eval_recent", 1, 1 << 22)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise InvalidArgument(name, f"must be in [{lo}, {hi}]", v)
        if not 0 < self.lr < 1:
            raise InvalidArgument("lr", "must be in (0, 1)", self.lr)
        if not 0 <= self.weight_decay < 1:
            raise InvalidArgument("weight_decay", "must be in [0, 1)", self.weight_decay)


@dataclass(frozen=True)
class TideConfig:
    buffer: BufferConfig = field(default_factory=BufferConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def train_config_from(spec: str) -> TrainConfig:
    """TrainConfig from "name=value,name=value" (`serve draft --adapt-train`): the trainer's settings by name,
    each converted to its field's type; an unknown name or a bad value is an InvalidArgument."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    kw: dict = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in types:
            raise InvalidArgument("adapt_train", f"name=value pairs of {sorted(types)}", item)
        try:
            kw[name] = float(value) if types[name] in ("float", float) else int(value)
        except ValueError:
            raise InvalidArgument(name, f"must be a {types[name]}", value) from None
    return TrainConfig(**kw)
