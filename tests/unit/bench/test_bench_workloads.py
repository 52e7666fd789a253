"""Workload generators: determinism, prefix structure, trace mapping, slicing, arrivals."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from prefixroute.bench import workloads as w
from prefixroute.bench.synthetic_text import block_text
from prefixroute.bench.traces import TraceFormatError, TraceRecord, load_trace, parse_trace_line, slice_trace, trace_prompt, trace_workload, write_trace
from prefixroute.bench.workload_spec import CHARS_PER_TOKEN, RequestSpec


def _common_prefix_len(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _text(r: RequestSpec) -> str:
    return r.prompt if r.prompt is not None else "".join(m["content"] for m in r.messages)


SMALL = dict(num_requests=40, seed=3, output_tokens=8, prefix_tokens=128, num_groups=4, question_tokens=16,
             num_sessions=5, num_turns=3, document_tokens=256, num_documents=6)


@pytest.mark.parametrize("name", w.WORKLOAD_NAMES)
def test_same_seed_same_requests_other_seed_differs(name):
    a = w.make_workload(name, **SMALL)
    b = w.make_workload(name, **SMALL)
    c = w.make_workload(name, **{**SMALL, "seed": 4})
    assert a.requests == b.requests
    assert [_text(r) for r in a.requests] != [_text(r) for r in c.requests]
    assert [r.index for r in a.requests] == list(range(len(a.requests)))


@pytest.mark.parametrize("num_tokens", [1, 2, 16, 100, 512])
def test_block_text_length_is_exactly_four_chars_per_token(num_tokens):
    assert len(block_text(0, "x", 1, num_tokens)) == num_tokens * CHARS_PER_TOKEN


@given(a=st.integers(0, 10**6), b=st.integers(0, 10**6))
@settings(max_examples=50, deadline=None)
def test_distinct_block_ids_share_less_than_one_cache_block(a, b):
    if a == b:
        return
    # 16 tokens = 64 chars: two different blocks must never share a whole cache block of text.
    assert _common_prefix_len(block_text(0, "h", a, 32), block_text(0, "h", b, 32)) < 64


def test_shared_prompts_structure():
    wl = w.shared_prompts(num_groups=3, prefix_tokens=100, question_tokens=10, num_requests=60, seed=1)
    by_group: dict[str, set[str]] = {}
    questions = set()
    for r in wl.requests:
        system, user = r.messages
        assert system["role"] == "system" and user["role"] == "user"
        assert len(system["content"]) == 400 and len(user["content"]) == 40
        by_group.setdefault(r.group_id, set()).add(system["content"])
        questions.add(user["content"])
    assert len(by_group) == 3  # 60 uniform draws over 3 groups: all appear
    assert all(len(s) == 1 for s in by_group.values())  # one system prompt per group
    assert len({next(iter(s)) for s in by_group.values()}) == 3  # and distinct across groups
    assert len(questions) == 60  # every question unique


def test_multi_turn_resends_growing_conversation():
    wl = w.multi_turn(num_sessions=3, num_turns=4, system_tokens=32, user_tokens=8, output_tokens=8,
                      max_active_sessions=2, seed=0)
    assert len(wl.requests) == 12
    last: dict[str, RequestSpec] = {}
    for r in wl.requests:
        prev = last.get(r.session_id)
        if prev is None:
            assert r.turn == 0 and r.after_index is None and len(r.messages) == 2
        else:
            assert r.turn == prev.turn + 1 and r.after_index == prev.index
            # The previous turn's messages are a prefix, then the assistant answer and a new question.
            assert r.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in r.messages[len(prev.messages):]] == ["assistant", "user"]
        last[r.session_id] = r
    # max_active_sessions=2: session 2 starts only after one of the first two has finished.
    first_turn_2 = next(r.index for r in wl.requests if r.session_id == "session-2")
    assert first_turn_2 >= 4 * 2 - 1


def test_documents_zipf_makes_first_document_most_popular():
    wl = w.documents(num_documents=10, document_tokens=64, num_requests=400, zipf_s=1.2, seed=2)
    counts: dict[str, int] = {}
    for r in wl.requests:
        counts[r.group_id] = counts.get(r.group_id, 0) + 1
        assert r.messages[1]["content"].startswith(block_text(2, "doc", int(r.group_id[4:]), 64))
    assert max(counts, key=counts.get) == "doc-0"
    assert counts["doc-0"] > 400 / 10 * 2


def test_mix_keeps_session_order_and_dependencies():
    wl = w.mix(num_requests=60, seed=5, prefix_tokens=64, document_tokens=64)
    assert len(wl.requests) == 60
    assert {r.group_id.split("/")[0] for r in wl.requests} == {"shared-prompts", "multi-turn", "documents"}
    for r in wl.requests:
        if r.after_index is not None:
            dep = wl.requests[r.after_index]
            assert dep.index < r.index and dep.session_id == r.session_id and dep.turn == r.turn - 1


# ---------------------------------------------------------------------------------------------- traces

RECORDS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]},
    {"timestamp": 2500, "input_length": 512, "output_length": 0, "hash_ids": [4]},
    {"timestamp": 4000, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
]


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    return p


def test_trace_mapping_blocks_and_partial_last_block(trace_file):
    recs = load_trace(trace_file)
    assert len(recs) == 4
    wl = trace_workload(recs, seed=9)
    texts = [_text(r) for r in wl.requests]
    blk = lambda h: block_text(9, "h", h, 512)  # noqa: E731
    # Lengths follow input_length exactly (4 chars per token), last block partial.
    assert [len(t) for t in texts] == [r["input_length"] * 4 for r in RECORDS]
    assert texts[0] == blk(0) + blk(1) + blk(2)[: (1100 - 1024) * 4]
    # Shared leading ids -> shared text prefix of exactly that many blocks.
    assert _common_prefix_len(texts[0], texts[1]) // 4 // 16 == 512 // 16
    assert texts[3] == blk(0) + blk(1)
    assert texts[0].startswith(texts[3])
    assert _common_prefix_len(texts[2], texts[0]) < 64
    # output_length 0 becomes 1 (a request generates at least one token).
    assert [r.max_tokens for r in wl.requests] == [5, 7, 1, 3]


@pytest.mark.parametrize("scale,expected", [(1.0, [0.0, 1.0, 2.5, 4.0]), (0.5, [0.0, 0.5, 1.25, 2.0]),
                                            (2.0, [0.0, 2.0, 5.0, 8.0])])
def test_trace_time_scaling(trace_file, scale, expected):
    wl = trace_workload(load_trace(trace_file), time_scale=scale)
    assert [r.arrival_s for r in wl.requests] == pytest.approx(expected)


@pytest.mark.parametrize("kw,expected_ts", [
    (dict(start=1), [1000, 2500, 4000]),
    (dict(start=1, stop=3), [1000, 2500]),
    (dict(start_s=1.0, end_s=4.0), [1000, 2500]),
    (dict(stop=3, start_s=2.0), [2500]),
    (dict(start_s=10.0), []),
])
def test_trace_slicing(trace_file, kw, expected_ts):
    recs = slice_trace(load_trace(trace_file), **kw)
    assert [r.timestamp_ms for r in recs] == expected_ts


def test_sliced_trace_arrivals_start_at_zero(trace_file):
    wl = trace_workload(slice_trace(load_trace(trace_file), start=2))
    assert [r.arrival_s for r in wl.requests] == pytest.approx([0.0, 1.5])


@pytest.mark.parametrize("line,fragment", [
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', "does not fit"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}', "does not fit"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}', "empty hash_ids"),
    ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "bad timestamp"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "bad timestamp"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing 'hash_ids'"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "integers"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}', "integers"),
    ('{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}', "integers"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "2"]}', "integers"),
    ('{"timestamp": "0", "input_length": 10, "output_length": 1, "hash_ids": [1]}', "number"),
    ("[1, 2]", "JSON object"),
    ("not json", "line 7: not JSON"),
])
def test_bad_trace_lines_name_the_line(line, fragment):
    with pytest.raises(TraceFormatError, match=fragment):
        parse_trace_line(line, 7)


def test_write_trace_round_trips(tmp_path, trace_file):
    recs = load_trace(trace_file)
    out = tmp_path / "copy.jsonl"
    write_trace(out, recs)
    assert load_trace(out) == recs


# --------------------------------------------------------------------------------------------- arrivals

def test_poisson_arrivals_are_seeded_and_have_the_rate():
    wl = w.shared_prompts(num_requests=2000, prefix_tokens=4, question_tokens=1, seed=0)
    a = w.apply_arrivals(wl, "poisson", rate_rps=20.0, seed=1)
    b = w.apply_arrivals(wl, "poisson", rate_rps=20.0, seed=1)
    times = [r.arrival_s for r in a.requests]
    assert times == [r.arrival_s for r in b.requests]
    assert times == sorted(times) and times[0] == 0.0
    # 1999 gaps of mean 1/20 s: the mean rate is within 10% (std of the mean ~2.2%).
    assert 1999 / times[-1] == pytest.approx(20.0, rel=0.1)


def test_closed_arrivals_clear_times_and_trace_arrivals_need_a_trace(trace_file):
    wl = trace_workload(load_trace(trace_file))
    assert all(r.arrival_s is None for r in w.apply_arrivals(wl, "closed").requests)
    assert w.apply_arrivals(wl, "trace") is wl
    with pytest.raises(ValueError, match="trace workload"):
        w.apply_arrivals(w.shared_prompts(num_requests=2), "trace")
    with pytest.raises(ValueError, match="rate_rps"):
        w.apply_arrivals(wl, "poisson", rate_rps=0)


@pytest.mark.parametrize("kw", [dict(num_groups=0), dict(num_requests=0), dict(prefix_tokens=-1)])
def test_invalid_sizes_are_rejected(kw):
    with pytest.raises(ValueError):
        w.shared_prompts(**kw)


def test_body_is_streaming_with_usage():
    r = w.shared_prompts(num_requests=1, prefix_tokens=4, question_tokens=1).requests[0]
    b = r.body("m")
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["messages"][0]["role"] == "system" and b["max_tokens"] == r.max_tokens and r.path == "/v1/chat/completions"


# ------------------------------------------------------------------------------------ property tests

@st.composite
def trace_records(draw):
    n = draw(st.integers(1, 6))
    ids = tuple(draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)))
    length = draw(st.integers(512 * (n - 1) + 1, 512 * n))
    return TraceRecord(float(draw(st.integers(0, 10**7))), length, draw(st.integers(0, 2000)), ids)


@given(rec=trace_records())
@settings(max_examples=60, deadline=None)
def test_any_valid_record_round_trips_and_maps_to_exact_length(rec):
    line = json.dumps({"timestamp": int(rec.timestamp_ms), "input_length": rec.input_length,
                       "output_length": rec.output_length, "hash_ids": list(rec.hash_ids)})
    assert parse_trace_line(line) == rec
    text = trace_prompt(rec, seed=1)
    assert len(text) == rec.input_length * CHARS_PER_TOKEN
    # Block k of the text is the block of hash id k (the last one possibly cut).
    for k, h in enumerate(rec.hash_ids):
        chunk = text[k * 2048:(k + 1) * 2048]
        assert block_text(1, "h", h, 512).startswith(chunk)


@given(a=trace_records(), b=trace_records())
@settings(max_examples=60, deadline=None)
def test_shared_leading_ids_share_exactly_that_text(a, b):
    k = 0
    while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
        k += 1
    ta, tb = trace_prompt(a), trace_prompt(b)
    common = _common_prefix_len(ta, tb)
    # Full shared blocks are shared text (up to the shorter prompt); a differing block adds < 64 chars.
    assert common >= min(k * 2048, len(ta), len(tb))
    if k < min(len(a.hash_ids), len(b.hash_ids)):
        assert common < k * 2048 + 64


@given(junk=st.text(max_size=80))
@settings(max_examples=100, deadline=None)
def test_parser_never_raises_anything_but_trace_format_error(junk):
    try:
        parse_trace_line(junk, 3)
    except TraceFormatError as exc:
        assert "line 3" in str(exc)


_json_values = st.recursive(st.none() | st.booleans() | st.integers(-10, 2000) | st.floats(allow_nan=True)
                            | st.text(max_size=5), lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@given(obj=st.fixed_dictionaries({"timestamp": _json_values, "input_length": _json_values,
                                  "output_length": _json_values, "hash_ids": _json_values}))
@settings(max_examples=200, deadline=None)
def test_parser_on_wrong_field_types_raises_only_trace_format_error(obj):
    try:
        rec = parse_trace_line(json.dumps(obj), 5)
    except TraceFormatError as exc:
        assert "line 5" in str(exc)
    else:
        assert 512 * (len(rec.hash_ids) - 1) < rec.input_length <= 512 * len(rec.hash_ids)


def test_other_block_sizes_map_the_same_way(tmp_path):
    p = tmp_path / "t16.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [7, 8]}\n')
    with pytest.raises(TraceFormatError, match="does not fit"):
        load_trace(p)  # 20 tokens do not fill 2 blocks of 512
    recs = load_trace(p, block_tokens=16)
    (r,) = trace_workload(recs, block_tokens=16, api="completions").requests
    assert r.prompt == block_text(0, "h", 7, 16) + block_text(0, "h", 8, 16)[:16]


def test_tenants_sessions_resend_their_tenants_prompt_and_history_and_popularity_is_skewed():
    wl = w.tenants(num_tenants=12, min_system_tokens=64, max_system_tokens=256, question_tokens=8, output_tokens=8,
                   num_requests=400, max_active_sessions=6, seed=1)
    assert len(wl.requests) == 400
    last: dict[str, RequestSpec] = {}
    system_of: dict[str, str] = {}
    for r in wl.requests:
        assert system_of.setdefault(r.group_id, r.messages[0]["content"]) == r.messages[0]["content"]
        assert 64 * CHARS_PER_TOKEN <= len(r.messages[0]["content"]) <= 256 * CHARS_PER_TOKEN
        prev = last.get(r.session_id)
        if prev is None:
            assert r.turn == 0 and r.after_index is None and len(r.messages) == 2
        else:
            assert r.group_id == prev.group_id and r.turn == prev.turn + 1 and r.after_index == prev.index
            assert r.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in r.messages[len(prev.messages):]] == ["assistant", "user"]
        last[r.session_id] = r
    assert len(set(system_of.values())) == len(system_of)  # one distinct prompt per tenant
    counts = sorted((sum(r.group_id == g for r in wl.requests) for g in system_of), reverse=True)
    assert counts[0] > 3 * 400 / 12, counts  # Zipf: the top tenant carries several times its even share
    assert max(r.turn for r in wl.requests) >= 2 and len(last) > 400 / 8  # multi-turn, many sessions
