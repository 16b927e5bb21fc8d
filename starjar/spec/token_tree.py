"""A token tree: what a tree proposal is, on the wire and in both engines.

Nodes are numbered 0..n-1 in topological order (a parent comes before its children); `parents[i]` is the
node that token i follows, or -1 when it follows the sequence's last verified token (the root, which is not
a node). Siblings are candidates for the same position, tried by verification in the order they appear.
`path_probs[i]` is the draft's probability of the whole path from the root to node i (AdaServe's f(v)
approximation); verification never reads it, selection does.

A chain is the degenerate tree parents = [-1, 0, 1, ...]. Any prefix of the node list is again a tree,
which is how a tree is cut to a node budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starjar.errors import InvalidArgument

MAX_TREE_NODES = 256  # one sequence's tree in one verification pass


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    path_probs: tuple[float, ...] = ()  # empty when the proposer gave none

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        object.__setattr__(self, "path_probs", tuple(float(p) for p in self.path_probs))
        self.validate()

    def validate(self) -> None:
        n = len(self.tokens)
        if n > MAX_TREE_NODES:
            raise InvalidArgument("tree", f"at most {MAX_TREE_NODES} nodes", n)
        if len(self.parents) != n:
            raise InvalidArgument("tree.parents", f"one per token ({n})", len(self.parents))
        if self.path_probs and len(self.path_probs) != n:
            raise InvalidArgument("tree.path_probs", f"one per token ({n}) or none", len(self.path_probs))
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise InvalidArgument("tree.parents", f"parents[{i}] must be in [-1, {i}) (topological order)", p)
        if any(not 0.0 <= q <= 1.0 for q in self.path_probs):
            raise InvalidArgument("tree.path_probs", "must be in [0, 1]", "out of range")

    @classmethod
    def chain(cls, tokens: Sequence[int], path_probs: Sequence[float] = ()) -> TokenTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), tuple(path_probs))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node: 1 for a child of the root."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self) -> list[list[int]]:
        """children()[0] are the root's children, children()[i + 1] node i's, each in candidate order."""
        out: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def prefix(self, n: int) -> TokenTree:
        """The first n nodes (still a tree: parents come first)."""
        n = max(0, min(n, len(self.tokens)))
        return TokenTree(self.tokens[:n], self.parents[:n], self.path_probs[:n])

    def within_depth(self, depth: int) -> TokenTree:
        """The nodes at most `depth` deep (parents of kept nodes are kept: they are shallower)."""
        depths = self.depths()
        keep = [i for i in range(len(self.tokens)) if depths[i] <= depth]
        if len(keep) == len(self.tokens):
            return self
        index = {n: i for i, n in enumerate(keep)}
        return TokenTree([self.tokens[n] for n in keep], [index.get(self.parents[n], -1) for n in keep],
                         [self.path_probs[n] for n in keep] if self.path_probs else ())

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
