"""`ConversationTable`: which requests continue a conversation, and how many more turns a new one will bring.
Pure: no I/O, no clock (times come from the caller).

A conversation (a chat, an agent in a tool loop) re-sends its whole history each turn, so turn k+1's prompt
extends turn k's: in chained block hashes, turn k's blocks appear at the same positions in turn k+1's hashes.
The table keys each conversation by one of its last turn's hashes, its *tail* (`tail_position`: two blocks before
the last, past the chat template's seam); a request whose hashes hold a known tail continues that conversation
(`find`), which then moves its tail into the request's hashes (`record`). A request that continues none starts
one: a *branch* off the prefix it matched (its *root*: the last matched block of a shared system prompt or tool
preamble, or no root when nothing matched).

Per root the table learns how many more turns a conversation brings (`Outlook.future_turns`: continuations per
conversation seen, counts halved as they grow so they follow a change of traffic) and what a turn costs (an
exponential average of its continuations' prefill work). One-off requests off a shared system prompt (a question
each) teach 0 future turns; agents in tool loops teach dozens. That is what the prefix policy needs to place a
conversation by the load it will bring (scheduling/conversation_load.py), not only by where its first request
is cheapest.

Lookup cost: a continuation's previous tail lies at or just below its best match (the previous turn's blocks are
cached, or pending, where it went: the match covers them), so `find` probes the hashes from a few blocks above
the best match down to `MAX_PROBE_BLOCKS` below it: O(1) dict lookups per request, never a walk of the prompt.
A conversation whose cached blocks were evicted is not found; its turn counts as a new branch.

Bounds: at most ``max_conversations`` conversations (least recently continued out; one not continued within
`END_AFTER_GAPS` of its gaps has ended) and ``max_roots`` roots; `CONVERSATION_ENTRY_BYTES` / `ROOT_ENTRY_BYTES`
each, measured. Keys are block hashes (8-byte ints) the router computed: nothing a client sends is kept. Not
thread-safe (one event loop), except `conversations_by_endpoint` and the counters (read by the metrics thread).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from prefixroute.types import BlockHash, EndpointId

CONVERSATION_ENTRY_BYTES = 240
"""Most bytes one conversation costs the table (its tail key, a `Conversation`, the LRU links), measured with
tracemalloc (tests/unit/routing/test_memory_bounds.py)."""
ROOT_ENTRY_BYTES = 220
"""Most bytes one root's statistics cost, measured the same way."""

MAX_PROBE_BLOCKS = 48
"""How far below its best match `find` looks for a conversation's previous tail. The previous turn's blocks are
usually matched exactly (they were recorded or stored where it went); KV events of a server that also caches
its generated tokens can match a few blocks more than the previous prompt (its answer, as re-sent); 48 blocks
(768 tokens) covers answers of that size while keeping a lookup to a few dozen dict probes at most."""
PROBE_ABOVE_BLOCKS = 2
"""`find` also looks this many blocks above the best match (a previous prompt still pending elsewhere, an index
that lost its last block)."""

TAIL_BACKOFF_BLOCKS = 2
"""A conversation is keyed by the hash two blocks before its prompt's last, not the last: the prompt ends with the
chat template's generation prompt (``<|start_header_id|>assistant<|end_header_id|>``: a few tokens), which the
next turn re-renders with the answer after it, and the tokens at that seam can differ (measured: the last block
of 6 of 400 agent turns did not recur in their next turn). Two blocks back (16-32 tokens) is past the seam. A
request whose own part (past its best match) is shorter than that is keyed by its last block, so a short
question after a shared prompt is never keyed inside the prompt that others share."""


def tail_position(num_blocks: int, best_match: int) -> int:
    """Where a request of `num_blocks` hashes, `best_match` of them matched, is keyed (`TAIL_BACKOFF_BLOCKS`)."""
    return min(num_blocks - 1, max(best_match, num_blocks - 1 - TAIL_BACKOFF_BLOCKS))


STATS_HALF_AT = 256.0
"""A root's counts are halved when its conversations reach this, so its future turns follow the traffic of the
last few hundred conversations."""
TURN_COST_WEIGHT = 1 / 16
"""Weight of the newest continuation in a root's average turn cost (an exponential average over ~16 turns)."""
PRIOR_BRANCHES = 2.0
"""A root seen for the first few times borrows the table's overall future turns, as if this many of its
conversations had brought them: a new tool preamble is assumed to behave as the others do until its own
conversations say otherwise."""
END_AFTER_S = 5.0
END_AFTER_GAPS = 8.0
"""A conversation not continued for 8 of its gaps between turns (its root's, while it has had one turn), and at
least 5 s, has ended: it leaves the table (a conversation that comes back later is a new branch)."""


@dataclasses.dataclass(slots=True)
class Conversation:
    """One conversation's last turn. Mutable only through `ConversationTable`."""

    endpoint: EndpointId
    root: BlockHash | None
    num_turns: int
    last_s: float | None
    gap_s: float | None  # exponential average of the time between its turns (None: one turn seen)
    num_tokens: float = 0.0  # its last turn's prompt tokens (the caller's estimate): what its endpoint holds
    placed_by_load: bool = False  # its last turn went where the load term put it, not where the time model did


@dataclasses.dataclass(slots=True)
class _Root:
    branches: float = 0.0  # conversations that started off it
    turns: float = 0.0  # continuations of its conversations
    turn_work: float = 0.0  # average prefill work of a continuation turn (the caller's units), 0: none seen
    gap_s: float = 0.0  # average time between two turns of its conversations, 0: none seen

    def future_turns(self, prior: float, prior_branches: float) -> float:
        """Expected further turns of one of its conversations: continuations per conversation seen so far,
        shrunk towards `prior` as if `prior_branches` conversations had brought that many. Conversations still
        going count with the turns they have had: between the remaining turns of one met at a random turn and
        the whole length of one that has ended, a cautious estimate of the load a new one brings."""
        return (self.turns + prior * prior_branches) / (self.branches + prior_branches)


@dataclasses.dataclass(slots=True)
class Outlook:
    """What a request's conversation will bring after this turn: `future_turns` more turns (>= 0; the root's
    learned mean), each costing about `turn_work` of prefill (the caller's units; 0 when unknown), one every
    `gap_s` seconds (None when unknown). `conversation`: the conversation it continues (None: a new branch);
    `root`: the prefix it branched from. Read-only by convention (a frozen dataclass costs ~3 us to build, on
    every decision)."""

    future_turns: float
    turn_work: float
    gap_s: float | None
    conversation: Conversation | None
    root: BlockHash | None
    tail_at: int  # index of the continued tail in the request's hashes, -1 for a new branch
    best_match: int = 0  # the request's longest match (blocks), where its own part begins


NO_OUTLOOK = Outlook(0.0, 0.0, None, None, None, -1)


class ConversationTable:
    """Conversations by tail hash, and per-root statistics (module docstring)."""

    __slots__ = ("_convs", "_roots", "max_conversations", "max_roots", "_all", "num_branches", "num_continued",
                 "num_ended", "num_placements", "num_placements_continued", "num_placements_ended")

    def __init__(self, max_conversations: int, max_roots: int) -> None:
        if max_conversations < 1 or max_roots < 1:
            raise ValueError("max_conversations and max_roots must be >= 1")
        self.max_conversations = max_conversations
        self.max_roots = max_roots
        self._convs: collections.OrderedDict[BlockHash, Conversation] = collections.OrderedDict()
        self._roots: collections.OrderedDict[BlockHash | None, _Root] = collections.OrderedDict()
        self._all = _Root()  # every root together: the prior of a root seen for the first times
        self.num_branches = 0
        self.num_continued = 0
        self.num_ended = 0
        # Turns the load term placed (`record`'s placed_by_load), and of those, the ones whose conversation then
        # continued (the placement paid off) or ended with that turn (it bought nothing: a recompute, maybe).
        self.num_placements = 0
        self.num_placements_continued = 0
        self.num_placements_ended = 0

    def __len__(self) -> int:
        return len(self._convs)

    def find(self, block_hashes: Sequence[BlockHash], best_match: int) -> int:
        """Index in `block_hashes` of a known conversation's tail (the request continues it), -1 when none:
        probes from `PROBE_ABOVE_BLOCKS` above `best_match` (the longest match any endpoint has) down to
        `MAX_PROBE_BLOCKS` below it. The request's own last block counts too: a prompt longer than the hashing
        cap has the same hashes turn after turn (what follows the cap is not hashed), and a prompt that comes
        back whole is one more turn of the same conversation as far as placement goes."""
        convs = self._convs
        if not convs:
            return -1
        n = len(block_hashes)
        hi = min(best_match + PROBE_ABOVE_BLOCKS, n)
        lo = max(0, best_match - MAX_PROBE_BLOCKS)
        for j in range(hi - 1, lo - 1, -1):
            if block_hashes[j] in convs:
                return j
        return -1

    def outlook(self, block_hashes: Sequence[BlockHash], best_match: int) -> Outlook:
        """The request's conversation (`find`) and what it will bring (`Outlook`)."""
        if not block_hashes:
            return NO_OUTLOOK
        at = self.find(block_hashes, best_match)
        if at >= 0:
            conv = self._convs[block_hashes[at]]
            root = conv.root
            gap = conv.gap_s
        else:
            conv = None
            root = block_hashes[best_match - 1] if best_match > 0 else None
            gap = None
        st = self._roots.get(root)
        overall = self._all
        prior = overall.future_turns(0.0, 1.0)
        if st is None:
            turns, work = prior, overall.turn_work
        else:
            turns = st.future_turns(prior, PRIOR_BRANCHES)
            work = st.turn_work or overall.turn_work
        return Outlook(turns, work, gap, conv, root, at, best_match)

    def record(self, block_hashes: Sequence[BlockHash], outlook: Outlook, endpoint: EndpointId,
               turn_work: float, now_s: float | None, num_tokens: float = 0.0, placed_by_load: bool = False) -> None:
        """The request (with `outlook` from `outlook`, `num_tokens` of prompt) was routed to `endpoint`, its prefill
        work there being `turn_work`: a continuation moves its conversation's tail to this request's last hash
        and counts a turn for its root; a new branch starts a conversation and counts a branch. A request
        without hashes is not recorded. `placed_by_load`: the load term chose its endpoint over the time model's
        (counted: right when the conversation then continues, wrong when it ends there)."""
        if not block_hashes:
            return
        tail = block_hashes[tail_position(len(block_hashes), outlook.best_match)]
        convs = self._convs
        conv = outlook.conversation
        if now_s is not None:
            self._expire(now_s)
        if conv is not None and outlook.tail_at >= 0:
            convs.pop(block_hashes[outlook.tail_at], None)
            st = self._root(conv.root)
            a = self._all
            w = TURN_COST_WEIGHT
            for x in (st, a):
                x.turns += 1.0
                x.turn_work = turn_work if not x.turn_work else x.turn_work + w * (turn_work - x.turn_work)
            if now_s is not None and conv.last_s is not None:
                gap = max(0.0, now_s - conv.last_s)
                conv.gap_s = gap if conv.gap_s is None else conv.gap_s + 0.25 * (gap - conv.gap_s)
                for x in (st, a):
                    x.gap_s = gap if not x.gap_s else x.gap_s + w * (gap - x.gap_s)
            if conv.placed_by_load:
                self.num_placements_continued += 1
            conv.endpoint = endpoint
            conv.num_turns += 1
            conv.last_s = now_s
            conv.num_tokens = num_tokens
            conv.placed_by_load = placed_by_load
            self.num_continued += 1
        else:
            st = self._root(outlook.root)
            for x in (st, self._all):
                x.branches += 1.0
                if x.branches >= STATS_HALF_AT:
                    x.branches *= 0.5
                    x.turns *= 0.5
            conv = Conversation(endpoint, outlook.root, 1, now_s, None, num_tokens, placed_by_load)
            self.num_branches += 1
        if placed_by_load:
            self.num_placements += 1
        convs[tail] = conv
        convs.move_to_end(tail)
        while len(convs) > self.max_conversations:
            self._ended(convs.popitem(last=False)[1])

    def _expire(self, now_s: float) -> None:
        """End the least recently continued conversations that waited past `END_AFTER_GAPS` of their gaps."""
        convs = self._convs
        roots = self._roots
        while convs:
            conv = next(iter(convs.values()))
            if conv.last_s is None:
                break
            gap = conv.gap_s
            if gap is None:
                st = roots.get(conv.root)
                gap = st.gap_s if st is not None else self._all.gap_s
            if now_s - conv.last_s <= max(END_AFTER_S, END_AFTER_GAPS * gap):
                break
            convs.popitem(last=False)
            self._ended(conv)

    def _ended(self, conv: Conversation) -> None:
        self.num_ended += 1
        if conv.placed_by_load:
            self.num_placements_ended += 1

    def record_followup(self, root: BlockHash) -> None:
        """A turn continued a conversation the table cannot see (a Responses follow-up: its prompt lives on the
        server, its hashes are only the prefix before its input, `root`): one more turn for that root's branches
        (whose turns branched off that prefix)."""
        self._root(root).turns += 1.0
        self._all.turns += 1.0
        self.num_continued += 1

    def _root(self, root: BlockHash | None) -> _Root:
        roots = self._roots
        st = roots.get(root)
        if st is None:
            st = roots[root] = _Root()
            while len(roots) > self.max_roots:
                roots.popitem(last=False)
        else:
            roots.move_to_end(root)
        return st

    def moved(self, block_hashes: Sequence[BlockHash], endpoint: EndpointId) -> None:
        """The request with these hashes was served by `endpoint` (a fallback): its conversation follows it."""
        n = len(block_hashes)
        for j in range(n - 1, max(-1, n - 2 - TAIL_BACKOFF_BLOCKS), -1):
            conv = self._convs.get(block_hashes[j])
            if conv is not None:
                conv.endpoint = endpoint
                return

    def forget_endpoint(self, endpoint: EndpointId) -> None:
        """`endpoint` left the pool or lost its cache: its conversations' next turns are new branches. O(n)."""
        for tail in [t for t, c in self._convs.items() if c.endpoint == endpoint]:
            del self._convs[tail]

    def conversations_by_endpoint(self) -> dict[EndpointId, int]:
        """Conversations whose last turn went to each endpoint (for metrics; a copy)."""
        out: dict[EndpointId, int] = {}
        for c in list(self._convs.values()):
            out[c.endpoint] = out.get(c.endpoint, 0) + 1
        return out


class ConversationsCollector:
    """A prometheus_client collector of a `ConversationTable`'s figures and the endpoints' recent prefill
    utilisation (`utilization()`: endpoint -> ratio, thread-safe). Read by the metrics thread: plain integers
    and copies; a torn read costs at most one count."""

    def __init__(self, table: ConversationTable, utilization) -> None:  # noqa: ANN001 - a callable
        self.table = table
        self.utilization = utilization

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = self.table
        by_endpoint = GaugeMetricFamily("prefixroute_conversations", "Conversations (requests extending an earlier "
                                        "request's prompt) the router follows, by the endpoint of their last turn.",
                                        labels=["endpoint"])
        for ep, n in sorted(t.conversations_by_endpoint().items()):
            by_endpoint.add_metric([str(ep)], n)
        yield by_endpoint
        turns = CounterMetricFamily("prefixroute_conversation_turns", "Routed requests by what they were to the "
                                    "conversation table: branch (a new conversation), continued (a further turn).",
                                    labels=["kind"])
        turns.add_metric(["branch"], t.num_branches)
        turns.add_metric(["continued"], t.num_continued)
        yield turns
        placed = CounterMetricFamily("prefixroute_conversation_placements", "Turns the conversation-load term sent "
                                     "elsewhere than the time model alone would (placed), and of those the ones "
                                     "whose conversation then continued, or ended with that turn (the recompute "
                                     "it may have cost bought nothing).", labels=["outcome"])
        placed.add_metric(["placed"], t.num_placements)
        placed.add_metric(["continued"], t.num_placements_continued)
        placed.add_metric(["ended"], t.num_placements_ended)
        yield placed
        load = GaugeMetricFamily("prefixroute_endpoint_prefill_utilization_ratio", "The router's estimate of the "
                                 "endpoint's recent prefill utilisation: predicted prefill seconds routed there per "
                                 "second, over ~10 s (what conversations are priced at).", labels=["endpoint"])
        for ep, rho in sorted(self.utilization().items()):
            load.add_metric([str(ep)], rho)
        yield load
