from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelFingerprint(_message.Message):
    __slots__ = ("vocab_size", "tokenizer_hash")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    tokenizer_hash: str
    def __init__(self, vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker_id", "fingerprint", "no_training")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NO_TRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    fingerprint: ModelFingerprint
    no_training: bool
    def __init__(self, worker_id: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., no_training: _Optional[bool] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_sequences", "max_tokens_per_sequence", "max_gamma", "max_message_bytes", "lease_seconds", "max_tree_width", "max_tree_nodes", "prefills_ahead", "prompt_kv_from")
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KV_FROM_FIELD_NUMBER: _ClassVar[int]
    max_sequences: int
    max_tokens_per_sequence: int
    max_gamma: int
    max_message_bytes: int
    lease_seconds: float
    max_tree_width: int
    max_tree_nodes: int
    prefills_ahead: bool
    prompt_kv_from: str
    def __init__(self, max_sequences: _Optional[int] = ..., max_tokens_per_sequence: _Optional[int] = ..., max_gamma: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., max_tree_width: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., prefills_ahead: _Optional[bool] = ..., prompt_kv_from: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("tag", "limits", "draft_model")
    TAG_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    tag: bytes
    limits: Limits
    draft_model: str
    def __init__(self, tag: _Optional[bytes] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., draft_model: _Optional[str] = ...) -> None: ...

class SequenceRound(_message.Message):
    __slots__ = ("seq_id", "start", "tokens", "gamma", "hidden_states", "tree_width", "prompt_kv")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KV_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    gamma: int
    hidden_states: bytes
    tree_width: int
    prompt_kv: bytes
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., gamma: _Optional[int] = ..., hidden_states: _Optional[bytes] = ..., tree_width: _Optional[int] = ..., prompt_kv: _Optional[bytes] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("round_id", "sequences")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceRound]
    def __init__(self, round_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceRound, _Mapping]]] = ...) -> None: ...

class SequenceDraft(_message.Message):
    __slots__ = ("seq_id", "tokens", "resync", "parents", "path_probs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PATH_PROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    resync: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    path_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., resync: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ..., path_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class RoundTimings(_message.Message):
    __slots__ = ("queue_wait_s", "compute_s", "batched_rounds")
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    queue_wait_s: float
    compute_s: float
    batched_rounds: int
    def __init__(self, queue_wait_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., batched_rounds: _Optional[int] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("round_id", "sequences", "timings", "staged")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDraft]
    timings: RoundTimings
    staged: _containers.RepeatedCompositeFieldContainer[StagedDrafts]
    def __init__(self, round_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDraft, _Mapping]]] = ..., timings: _Optional[_Union[RoundTimings, _Mapping]] = ..., staged: _Optional[_Iterable[_Union[StagedDrafts, _Mapping]]] = ...) -> None: ...

class StagedDrafts(_message.Message):
    __slots__ = ("seq_id", "start", "assumed", "drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    assumed: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., assumed: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("tag", "seq_ids", "detach")
    TAG_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    tag: bytes
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    detach: bool
    def __init__(self, tag: _Optional[bytes] = ..., seq_ids: _Optional[_Iterable[int]] = ..., detach: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetRate(_message.Message):
    __slots__ = ("worker_id", "rounds_per_s", "rounds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rounds_per_s: float
    rounds: int
    def __init__(self, worker_id: _Optional[str] = ..., rounds_per_s: _Optional[float] = ..., rounds: _Optional[int] = ...) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("attached_targets", "live_sequences", "queue_depth", "mode", "rounds", "batches", "drafted_tokens", "draft_steps", "mean_step_s", "mean_service_s", "mean_wait_s", "mean_idle_s", "load", "rounds_per_s", "targets", "uptime_s", "refused_admission", "reclaimed_sequences", "max_targets", "busy_s", "idle_s", "tide_acceptance_short", "tide_acceptance_long", "tide_collecting", "tide_train_steps", "tide_swaps", "tide_train_s", "tide_buffered_sequences", "tide_buffered_tokens", "tide_heldout_acceptance", "tide_cycles", "tree_rounds", "tree_nodes", "tree_expand_s", "lookahead_hits", "lookahead_misses", "lookahead_drafted_tokens", "lookahead_wasted_tokens", "lookahead_prefilled_tokens", "lookahead_branch_hits")
    ATTACHED_TARGETS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TARGETS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TIDE_ACCEPTANCE_SHORT_FIELD_NUMBER: _ClassVar[int]
    TIDE_ACCEPTANCE_LONG_FIELD_NUMBER: _ClassVar[int]
    TIDE_COLLECTING_FIELD_NUMBER: _ClassVar[int]
    TIDE_TRAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    TIDE_SWAPS_FIELD_NUMBER: _ClassVar[int]
    TIDE_TRAIN_S_FIELD_NUMBER: _ClassVar[int]
    TIDE_BUFFERED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TIDE_BUFFERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIDE_HELDOUT_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    TIDE_CYCLES_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_EXPAND_S_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_WASTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_BRANCH_HITS_FIELD_NUMBER: _ClassVar[int]
    attached_targets: int
    live_sequences: int
    queue_depth: int
    mode: str
    rounds: int
    batches: int
    drafted_tokens: int
    draft_steps: int
    mean_step_s: float
    mean_service_s: float
    mean_wait_s: float
    mean_idle_s: float
    load: float
    rounds_per_s: float
    targets: _containers.RepeatedCompositeFieldContainer[TargetRate]
    uptime_s: float
    refused_admission: int
    reclaimed_sequences: int
    max_targets: int
    busy_s: float
    idle_s: float
    tide_acceptance_short: float
    tide_acceptance_long: float
    tide_collecting: bool
    tide_train_steps: int
    tide_swaps: int
    tide_train_s: float
    tide_buffered_sequences: int
    tide_buffered_tokens: int
    tide_heldout_acceptance: float
    tide_cycles: int
    tree_rounds: int
    tree_nodes: int
    tree_expand_s: float
    lookahead_hits: int
    lookahead_misses: int
    lookahead_drafted_tokens: int
    lookahead_wasted_tokens: int
    lookahead_prefilled_tokens: int
    lookahead_branch_hits: int
    def __init__(self, attached_targets: _Optional[int] = ..., live_sequences: _Optional[int] = ..., queue_depth: _Optional[int] = ..., mode: _Optional[str] = ..., rounds: _Optional[int] = ..., batches: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., draft_steps: _Optional[int] = ..., mean_step_s: _Optional[float] = ..., mean_service_s: _Optional[float] = ..., mean_wait_s: _Optional[float] = ..., mean_idle_s: _Optional[float] = ..., load: _Optional[float] = ..., rounds_per_s: _Optional[float] = ..., targets: _Optional[_Iterable[_Union[TargetRate, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., refused_admission: _Optional[int] = ..., reclaimed_sequences: _Optional[int] = ..., max_targets: _Optional[int] = ..., busy_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., tide_acceptance_short: _Optional[float] = ..., tide_acceptance_long: _Optional[float] = ..., tide_collecting: _Optional[bool] = ..., tide_train_steps: _Optional[int] = ..., tide_swaps: _Optional[int] = ..., tide_train_s: _Optional[float] = ..., tide_buffered_sequences: _Optional[int] = ..., tide_buffered_tokens: _Optional[int] = ..., tide_heldout_acceptance: _Optional[float] = ..., tide_cycles: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., tree_expand_s: _Optional[float] = ..., lookahead_hits: _Optional[int] = ..., lookahead_misses: _Optional[int] = ..., lookahead_drafted_tokens: _Optional[int] = ..., lookahead_wasted_tokens: _Optional[int] = ..., lookahead_prefilled_tokens: _Optional[int] = ..., lookahead_branch_hits: _Optional[int] = ...) -> None: ...
