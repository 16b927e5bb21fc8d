"""The target engine's statistics: filled in the step, read by the metrics collector, the controller and
the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from starjar.spec.draft_cap import MAX_DRAFT_TOKENS

MAX_GAMMA = MAX_DRAFT_TOKENS  # the most drafts one sequence may ask for in a step (a request's cap at most)


@dataclass
class StepTally:
    """Decode steps of one kind: how many, their time and the tokens they emitted."""
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    spec_rounds: int = 0  # sequence-rounds that carried drafts
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    proposer_failures: int = 0
    resyncs: int = 0
    preemptions: int = 0
    draft_prefill_steps: int = 0  # decode steps kept out of the policy's statistics: the draft prefilled a prompt
    tree_rounds: int = 0  # sequence-rounds that verified a token tree (branching, not a chain)
    tree_nodes: int = 0  # their nodes, after selection
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    # Decode steps split three ways: drafts verified (spec), none asked for (plain), asked for and none came
    # (fallback: refusal, deadline, resync). The controller's admission model and saturation guard compare
    # tokens per second of step time with and without speculation; plain is decoding alone, untouched by a
    # failed draft round.
    spec: StepTally = field(default_factory=StepTally)
    plain: StepTally = field(default_factory=StepTally)
    fallback: StepTally = field(default_factory=StepTally)

    def observe_round(self, drafted: int, accepted: int, tree: bool = False) -> None:
        """One sequence's part of a decode step: `drafted` drafts verified (the nodes of a tree when `tree`),
        `accepted` of them kept."""
        if tree:
            self.tree_rounds += 1
            self.tree_nodes += drafted
        if drafted:
            self.spec_rounds += 1
            for pos in range(accepted):
                self.accepted_per_position[pos] += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted

    def observe_step(self, step_s: float, verify_s: float, tokens: int, drafted: int, asked: bool) -> str:
        """One decode step: its time (drafting included), the part spent verifying, the tokens it emitted,
        the drafts it verified and whether any were asked for. Returns its kind: spec, plain or fallback."""
        self.decode_steps += 1
        self.verify_s += verify_s
        # Drafts asked for and none came: the cost of trying, not plain decoding.
        kind = "spec" if drafted else "fallback" if asked else "plain"
        getattr(self, kind).add(step_s, tokens)
        return kind

    def step_kinds(self) -> dict:
        """The three tallies as flat fields: spec_steps, spec_step_s, spec_tokens, plain_..., fallback_..."""
        return {f"{kind}_{key}": value for kind in ("spec", "plain", "fallback")
                for key, value in (("steps", getattr(self, kind).steps), ("step_s", getattr(self, kind).seconds),
                                   ("tokens", getattr(self, kind).tokens))}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per speculative sequence-round: accepted drafts + 1."""
        return (self.accepted_tokens + self.spec_rounds) / self.spec_rounds if self.spec_rounds else 0.0
