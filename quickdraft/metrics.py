"""SpecStats: the counters of speculative decoding and the rates derived from them.

Kept apart from their export: the CLI, the bench and the server's Prometheus exporter
all read this one type. Names follow vLLM's spec_decode metrics where one exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # steps in which the proposer drafted >= 1 token
    num_draft_tokens: int = 0  # tokens drafted
    num_accepted_tokens: int = 0  # drafted tokens the verifier kept
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted count at draft position i
    num_steps: int = 0  # target verify/decode forwards (prefill not counted)
    num_output_tokens: int = 0  # generated tokens returned to the caller (after stop cuts)
    elapsed_s: float = 0.0  # wall time spent generating
    num_forced_tokens: int = 0  # accepted tokens a constraint forced (proposed in the proposer's place)

    def observe(self, num_drafted: int, num_accepted: int, per_position: list[int] | None = None) -> None:
        """Record one step: `num_drafted` proposed, `num_accepted` kept. `per_position`
        defaults to the chain case, where exactly the first `num_accepted` were kept."""
        self.num_steps += 1
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if per_position is None:
            per_position = [1] * num_accepted + [0] * (num_drafted - num_accepted)
        if len(self.accepted_per_pos) < len(per_position):
            self.accepted_per_pos.extend([0] * (len(per_position) - len(self.accepted_per_pos)))
        for i, a in enumerate(per_position):
            self.accepted_per_pos[i] += a

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += a
        self.num_steps += other.num_steps
        self.num_output_tokens += other.num_output_tokens
        self.elapsed_s += other.elapsed_s
        self.num_forced_tokens += other.num_forced_tokens

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's definition: 1 + accepted / drafts, over the steps that drafted (0 when none did)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def tokens_per_step(self) -> float:
        """1 + accepted / steps over every target step, drafting or not: what the speedup
        follows (differs from mean_acceptance_length when a proposer skips steps)."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "num_steps": self.num_steps,
            "num_output_tokens": self.num_output_tokens,
            "elapsed_s": self.elapsed_s,
            "num_forced_tokens": self.num_forced_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
        }
