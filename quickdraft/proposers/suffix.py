"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975): speculate from what followed
the context's tail in this request and in earlier requests' outputs.

Both stores behave as depth-bounded suffix tries: every window tokens[i : i+D] of a
sequence (D = `max_tree_depth`) is a path from the root, and a node counts the windows
through it, i.e. the occurrences of its string. To speculate for a row we find the longest
tail of its context (at most `max_match` tokens) that occurred before with a continuation,
then grow a tree from that node best-first: a child's score is its parent's score times
child.count / (the sum of its siblings' counts), nodes are added while score >=
`min_token_prob`, at depth <= k (and <= D - match length: the trie holds no deeper), up to
min(`max_spec_tokens`, ceil(`max_spec_factor` * match length + `max_spec_offset`)) nodes.
Longer matches are more trustworthy, so they get longer speculation. The sum of the
scores estimates the tokens a tree will get accepted; the store whose candidate scores
higher wins (this request's on a tie). `tree=False` follows the likeliest child only.

- This request (prompt + output, per row): the trie's answers are read straight off the
  row's token buffer: the node of a tail is the set of its earlier end positions (found
  by the same vectorised search as n-gram lookup), its children are the tokens after
  them, grouped. Those are the counts an explicit trie would hold, without building ~D
  nodes per context token (~100k Python-side nodes and tens of ms for a 4096-token
  prompt); start() only copies the prompt. Ties between equally frequent children go to the one
  seen most recently. The current occurrence of the tail has no continuation, so it never
  counts as a match.
- Earlier requests (global): an explicit `CountTrie` over the outputs of finished requests
  (`finish`), holding at most `global_max_tokens` tokens: the oldest outputs are evicted
  first, their windows' counts taken back and emptied nodes freed, so it never holds more
  than held tokens * D nodes. A request's own output joins it only when it finishes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..errors import QuickdraftError
from .base import Draft, ProposeBatch, Proposer, check_int, check_options, register
from .ngram import RowTokens, TokenRows, tail_matches

# children(handle, min_share) -> ([(token, count, child handle)] likelier first, total count
# over all children). Children with count < min_share * total may be left out.
Children = Callable[[object, float], tuple[list[tuple[int, int, object]], int]]


class CountTrie:
    """A depth-bounded trie of token windows with counts, supporting removal.

    Nodes are ints. Per node: `token` (on the edge into it), `count` (windows through
    it) and `only`: its single child, -1 for none, or -2 when its children are in the
    dict `multi[node]` (token -> child). Most nodes of a deep trie have one child, so
    they cost 12 bytes; the root always uses `multi`. Freed node ids are reused.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.token = array("i", [-1])
        self.count = array("i", [0])
        self.only = array("i", [-2])
        self.multi: dict[int, dict[int, int]] = {0: {}}
        self.free: list[int] = []
        self.num_nodes = 0  # excluding the root

    def child(self, node: int, t: int) -> int:
        o = self.only[node]
        if o >= 0:
            return o if self.token[o] == t else -1
        return self.multi[node].get(t, -1) if o == -2 else -1

    def _unlink(self, node: int, t: int) -> None:
        if self.only[node] >= 0:
            self.only[node] = -1
            return
        kids = self.multi[node]
        del kids[t]
        if len(kids) == 1 and node != 0:
            (self.only[node],) = kids.values()
            del self.multi[node]

    def add(self, tokens: Sequence[int]) -> None:
        """Count every window tokens[i : i+depth] once more."""
        D, token, count, only, multi = self.depth, self.token, self.count, self.only, self.multi
        for i in range(len(tokens)):
            window = tokens[i : i + D]
            node = 0
            for d, t in enumerate(window):
                o = only[node]
                if o >= 0:
                    c = o if token[o] == t else -1
                else:
                    c = multi[node].get(t, -1) if o == -2 else -1
                if c < 0:  # the rest of the window is new
                    self._new_path(node, window[d:])
                    break
                count[c] += 1
                node = c

    def _new_path(self, node: int, path: Sequence[int]) -> None:
        """Hang a chain of new nodes (count 1) spelling `path` below `node`, which has no
        child path[0]. Reuses freed ids first; fresh ones are appended in bulk."""
        token, count, only, free = self.token, self.count, self.only, self.free
        reuse = min(len(free), len(path))
        ids = free[len(free) - reuse :]
        del free[len(free) - reuse :]
        fresh = len(path) - reuse
        ids.extend(range(len(token), len(token) + fresh))
        for i in range(reuse):
            c = ids[i]
            token[c], count[c], only[c] = path[i], 1, ids[i + 1] if i + 1 < len(ids) else -1
        if fresh:
            token.extend(path[reuse:])
            count.extend([1] * fresh)
            only.extend(ids[reuse + 1 :])
            only.append(-1)
        c, t, o = ids[0], path[0], only[node]
        if o == -1:
            only[node] = c
        elif o >= 0:
            self.multi[node] = {token[o]: o, t: c}
            only[node] = -2
        else:
            self.multi[node][t] = c
        self.num_nodes += len(path)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo add(tokens): nodes whose count drops to 0 are freed."""
        D, token, count, only, free = self.depth, self.token, self.count, self.only, self.free
        for i in range(len(tokens)):
            node = 0
            for t in tokens[i : i + D]:
                c = self.child(node, t)
                if c < 0:
                    raise ValueError("removing a window that was never added")
                if count[c] == 1:
                    # Only this window passed through c, so c's subtree is the rest of
                    # its path, a chain: free it all.
                    self._unlink(node, t)
                    while c >= 0:
                        below = only[c]
                        token[c], count[c], only[c] = -1, 0, -1
                        free.append(c)
                        self.num_nodes -= 1
                        c = below
                    break
                count[c] -= 1
                node = c

    def find(self, path: Sequence[int]) -> int:
        node = 0
        for t in path:
            node = self.child(node, t)
            if node < 0:
                return -1
        return node

    def longest_match(self, context: Sequence[int], max_len: int) -> tuple[int, int]:
        """(m, node): the longest tail context[-m:], m <= max_len, whose node has children.
        If a tail has a continuation so has each shorter tail, so binary search works."""
        lo, found = 0, -1
        hi = min(max_len, len(context), self.depth - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[len(context) - mid :])
            if node > 0 and self.only[node] != -1:
                lo, found = mid, node
            else:
                hi = mid - 1
        return lo, found

    def children(self, node: int, min_share: float = 0.0) -> tuple[list[tuple[int, int, int]], int]:
        o = self.only[node]
        if o >= 0:
            return [(self.token[o], self.count[o], o)], self.count[o]
        if o == -1:
            return [], 0
        count = self.count
        kids = [(t, count[c], c) for t, c in self.multi[node].items()]
        kids.sort(key=lambda kid: -kid[1])  # stable: equal counts keep insertion order
        return kids, sum(kid[1] for kid in kids)

    def windows(self) -> dict[tuple[int, ...], int]:
        """Every path from the root with its count (for tests)."""
        out, stack = {}, [((), 0)]
        while stack:
            path, node = stack.pop()
            for t, n, c in self.children(node)[0]:
                out[path + (t,)] = n
                stack.append((path + (t,), c))
        return out


def local_children(buf: np.ndarray, context: list[int]) -> Children:
    """Children over one row's tokens (`buf` and the same as a list): a handle holds the
    ascending end positions of a string's occurrences (an array, or a list when short);
    its children are the tokens after them, grouped."""
    n = len(context)

    def children(ends, min_share: float):
        if len(ends) <= 32:  # few occurrences: plain Python is quicker than numpy calls
            groups: dict[int, list[int]] = {}
            for p in ends if isinstance(ends, list) else ends.tolist():
                if p + 1 < n:  # occurrences running into the end have no next token
                    groups.setdefault(context[p + 1], []).append(p + 1)
            total = sum(len(g) for g in groups.values())
            # Most often first, then most recently seen (positions ascend within a group).
            kids = sorted(groups.items(), key=lambda item: (-len(item[1]), -item[1][-1]))
            return [(t, len(g), g) for t, g in kids], total
        after = ends + 1
        after = after[after < n]
        following = buf[after]
        if (following == following[0]).all():  # repetitive text: one continuation
            return [(int(following[0]), len(after), after)], len(after)
        tokens, inverse, counts = np.unique(following, return_inverse=True, return_counts=True)
        latest = np.zeros(len(tokens), dtype=np.int64)
        np.maximum.at(latest, inverse, after)
        keep = np.flatnonzero(counts >= min_share * len(after) * (1 - 1e-9))  # the rest score too low
        keep = keep[np.lexsort((-latest[keep], -counts[keep]))]  # most often, then most recent
        grouped = after[np.argsort(inverse, kind="stable")]  # ascending within each token
        starts = np.cumsum(counts) - counts
        return [(int(tokens[g]), int(counts[g]), grouped[starts[g] : starts[g] + counts[g]])
                for g in keep], len(after)

    return children


def grow(root, children: Children, budget: int, max_depth: int, min_prob: float,
         tree: bool) -> tuple[list[int], list[int], float]:
    """Best-first speculation below a matched node: (tokens, parents, total score), parents
    before children and siblings likelier first; a chain when `tree` is False."""
    tokens: list[int] = []
    parents: list[int] = []
    total = 0.0
    heap: list = []  # (-score, push order, token, parent node, depth, handle)
    order = itertools.count()  # equal scores: first pushed first (siblings keep their order)

    def expand(handle, node: int, score: float, depth: int) -> None:
        if depth >= max_depth:
            return
        kids, count_sum = children(handle, min_prob / score)
        for t, count, child in kids:
            s = score * count / count_sum
            if s < min_prob:
                break  # kids come likelier first
            heapq.heappush(heap, (-s, next(order), t, node, depth + 1, child))
            if not tree:
                break

    if budget > 0:
        expand(root, -1, 1.0, 0)
    while heap and len(tokens) < budget:
        neg, _, t, parent, depth, handle = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        total -= neg
        if len(tokens) < budget:
            expand(handle, len(tokens) - 1, -neg, depth)
    return tokens, parents, total


@register("suffix")
class SuffixProposer(TokenRows, Proposer):
    OPTIONS = ("max_tree_depth", "max_match", "max_spec_tokens", "max_spec_factor", "max_spec_offset",
               "min_token_prob", "global_max_tokens", "tree")

    def __init__(self, *, max_tree_depth: int = 24, max_match: int = 16, max_spec_tokens: int = 16,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                 global_max_tokens: int = 200_000, tree: bool = True, device: torch.device | str = "cpu"):
        check_int("max_tree_depth", max_tree_depth, 2)
        check_int("max_match", max_match, 1)
        if max_match >= max_tree_depth:
            raise QuickdraftError(f"max_match ({max_match}) must be < max_tree_depth ({max_tree_depth}): "
                                  "a matched tail needs trie depth left for its continuation")
        check_int("max_spec_tokens", max_spec_tokens, 1)
        for name, value in (("max_spec_factor", max_spec_factor), ("max_spec_offset", max_spec_offset),
                            ("min_token_prob", min_token_prob)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise QuickdraftError(f"{name} must be a finite number, got {value!r}")
        if max_spec_factor < 0:
            raise QuickdraftError(f"max_spec_factor must be >= 0, got {max_spec_factor}")
        if not 0 <= min_token_prob <= 1:
            raise QuickdraftError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        check_int("global_max_tokens", global_max_tokens, 0)
        if not isinstance(tree, bool):
            raise QuickdraftError(f"tree must be true or false, got {tree!r}")
        self.max_tree_depth = max_tree_depth  # D: longest window either trie holds
        self.max_match = max_match  # longest context tail matched
        self.max_spec_tokens = max_spec_tokens  # most draft nodes per row and step
        self.max_spec_factor = max_spec_factor  # node budget per matched token ...
        self.max_spec_offset = max_spec_offset  # ... plus this
        self.min_token_prob = min_token_prob  # smallest path probability speculated
        self.global_max_tokens = global_max_tokens  # earlier outputs kept; 0 = no global trie
        self.tree = tree  # False: the likeliest path only (a chain)
        self.device = torch.device(device)
        self.rows: dict[int, RowTokens] = {}
        self.trie = CountTrie(max_tree_depth)
        self.held: deque[array] = deque()  # outputs in the global trie, oldest first
        self.held_tokens = 0

    @classmethod
    def build(cls, *, target, draft=None, **options) -> SuffixProposer:
        if draft is not None:
            raise QuickdraftError("method 'suffix' speculates from suffix tries and takes no draft model")
        check_options("suffix", options, cls.OPTIONS)
        return cls(**options, device=target.device)

    def budget(self, match_len: int) -> int:
        """Draft nodes allowed for a match of `match_len` tokens."""
        return min(self.max_spec_tokens, math.ceil(self.max_spec_factor * match_len + self.max_spec_offset))

    def max_draft_tokens(self, k: int) -> int:
        most = max(1, self.budget(self.max_match))
        return most if self.tree else min(k, most)

    def may_draft_trees(self, k: int) -> bool:
        # (a tree at any k: at k >= max_spec_tokens its node budget is no larger than k, yet it
        # branches wherever the counts do)
        return self.tree

    @property
    def global_nodes(self) -> int:
        """Nodes of the global trie: at most held_tokens * max_tree_depth."""
        return self.trie.num_nodes

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        super().finish(row, tokens, prompt_len)
        self.remember(tokens[prompt_len:])

    def forget_requests(self) -> None:
        self.trie = CountTrie(self.max_tree_depth)
        self.held.clear()
        self.held_tokens = 0

    def remember(self, output: Sequence[int]) -> None:
        """Add an output to the global trie, evicting the oldest to stay within bounds."""
        if self.global_max_tokens == 0 or not output:
            return
        kept = array("i", output[-self.global_max_tokens :])  # an output longer than all: its end
        while self.held and self.held_tokens + len(kept) > self.global_max_tokens:
            old = self.held.popleft()
            self.trie.remove(old)
            self.held_tokens -= len(old)
        self.trie.add(kept)
        self.held.append(kept)
        self.held_tokens += len(kept)

    def speculate_local(self, buf: np.ndarray, context: list[int], k: int) -> tuple[list[int], list[int], float]:
        ends, lengths = tail_matches(buf, 1, self.max_match)
        if len(ends) == 0:
            return [], [], 0.0
        m = int(lengths.max())
        return grow(ends[lengths == m], local_children(buf, context), self.budget(m),
                    min(k, self.max_tree_depth - m), self.min_token_prob, self.tree)

    def speculate_global(self, context: list[int], k: int) -> tuple[list[int], list[int], float]:
        if self.trie.num_nodes == 0:
            return [], [], 0.0
        m, node = self.trie.longest_match(context, self.max_match)
        if m == 0:
            return [], [], 0.0
        return grow(node, self.trie.children, self.budget(m), min(k, self.max_tree_depth - m),
                    self.min_token_prob, self.tree)

    def propose(self, batch: ProposeBatch) -> Draft:
        rows = []
        for b, context in enumerate(batch.tokens):
            k, tokens = batch.row_k(b), self.row_tokens(b, context)  # (every row's kept in step)
            if k == 0:
                rows.append(([], [], 0.0))
                continue
            local = self.speculate_local(tokens, context, k)
            other = self.speculate_global(context, k)
            rows.append(local if local[2] >= other[2] else other)
        if self.tree:
            return Draft.tree([(t, p) for t, p, _ in rows], self.device)
        return Draft.chain([t for t, _, _ in rows], self.device)
