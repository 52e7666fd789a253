"""The simulated server over real HTTP: OpenAI/vLLM formats, usage, metrics, errors, faults, shutdown."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.model_server import start_server
from helpers.waiting import until_async


async def _health(s: aiohttp.ClientSession, url: str) -> int | None:
    """GET /health's status, None when the connection is refused."""
    try:
        async with s.get(url + "/health") as r:
            return r.status
    except aiohttp.ClientConnectionError:
        return None


async def _refused(host: str, port: int) -> bool:
    try:
        _, w = await asyncio.open_connection(host, port)
    except OSError:
        return True
    w.close()
    return False

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.05")


async def sse_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    raw = await resp.read()
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    for e in events:
        assert e.startswith(b"data: "), e
    return [e[len(b"data: "):] for e in events]


def metric_samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name
            if s.name.endswith("_bucket"):
                key += "{le=" + s.labels["le"] + "}"
            out[key] = s.value
    return out


async def test_chat_stream_format_usage_and_headers(server_factory):
    srv = server_factory(*FAST, "--id", "alpha", "--admin-port", "0")
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "stream": True, "max_tokens": 7,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello " * 100}]}
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/v1/chat/completions", json=body, headers={"traceparent": tp}) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-prefixroute-server-id"] == "alpha"
            # The traceparent reached the server and is never echoed (the router's span id keys its facts records).
            assert not any(tp in v for v in r.headers.values()) and "x-prefixroute-traceparent" not in r.headers
            events = await sse_events(r)
        async with s.get(srv.admin_url + "/admin/traceparents") as r:
            assert (await r.json())[-1] == tp
        async with s.post(srv.url + "/tokenize", json={"messages": body["messages"]}) as r:
            count = (await r.json())["count"]
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"]]
    assert len(content) == 1 + 7
    assert [c["choices"][0]["finish_reason"] for c in content[1:]] == [None] * 6 + ["length"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] == count
    assert usage["total_tokens"] == count + 7
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_completion_nonstream_then_cached_and_metrics_agree(server_factory):
    srv = server_factory(*FAST)
    prompt = "The quick brown fox jumps over the lazy dog. " * 60  # ~675 tokens
    usages = []
    async with aiohttp.ClientSession() as s:
        for suffix in ("first ending", "another ending"):
            async with s.post(srv.url + "/v1/completions", json={"prompt": prompt + suffix, "max_tokens": 5}) as r:
                assert r.status == 200
                data = await r.json()
            assert data["object"] == "text_completion"
            assert data["choices"][0]["finish_reason"] == "length"
            assert len(data["choices"][0]["text"].split()) == 5
            usages.append(data["usage"])
        async with s.post(srv.url + "/v1/completions",
                          json={"prompt": prompt, "max_tokens": 3, "stream": True}) as r:
            events = await sse_events(r)
        async with s.post(srv.url + "/tokenize", json={"prompt": prompt}) as r:
            third_count = (await r.json())["count"]
        async with s.get(srv.url + "/metrics") as r:
            assert r.status == 200
            m = metric_samples(await r.text())
    assert events[-1] == b"[DONE]" and len(events) == 4  # no usage chunk without include_usage
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= usages[1]["prompt_tokens"] - 32 and cached % 16 == 0
    assert m["vllm:request_success_total"] == 3
    assert m["vllm:generation_tokens_total"] == 5 + 5 + 3
    assert m["vllm:prefix_cache_hits_total"] >= cached + cached - 16  # third request hits the same blocks
    assert m["vllm:prefix_cache_queries_total"] == m["vllm:prompt_tokens_total"]
    assert m["vllm:prompt_tokens_total"] == usages[0]["prompt_tokens"] + usages[1]["prompt_tokens"] + third_count
    assert m["vllm:time_to_first_token_seconds_count"] == 3
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
    assert m["vllm:cache_config_info"] == 1


async def test_models_tokenize_probes_and_lora(server_factory):
    srv = server_factory(*FAST, "--served-model-name", "base", "--lora-modules", "ad1,ad2", "--num-gpu-blocks", "500")
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/v1/models") as r:
            models = [d["id"] for d in (await r.json())["data"]]
        async with s.get(srv.url + "/health") as r:
            assert r.status == 200
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            async with s.get(srv.url + path) as r:
                assert r.status == 200, path
                assert (await r.json())["model_path"] == "base"
        async with s.post(srv.url + "/tokenize", json={"model": "base", "prompt": "abcdefgh"}) as r:
            tok = await r.json()
        # an adapter is a cache extra key: same prompt on another adapter gets no hit
        prompt = "shared words " * 100
        cached = []
        for model in ("ad1", "ad1", "ad2"):
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert models == ["base", "ad1", "ad2"]
    assert tok["count"] == 2 and len(tok["tokens"]) == 2 and tok["max_model_len"] == 500 * 16
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0


ERRORS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", orjson.dumps({"max_tokens": 3}), 400, "messages"),
    ("/v1/chat/completions", orjson.dumps({"messages": "hi"}), 400, "messages"),
    ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "wizard", "content": "x"}]}), 400,
     "messages[0].role"),
    ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}),
     400, "max_tokens"),
    ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
     400, "stream"),
    ("/v1/chat/completions", orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
     404, "model"),
    ("/v1/completions", orjson.dumps({"prompt": "word " * 2000, "max_tokens": 10}), 400, "prompt"),
    ("/v1/completions", orjson.dumps({"prompt": 12}), 400, "prompt"),
    ("/v1/completions", orjson.dumps({"prompt": "x", "n": 2}), 400, "n"),
    ("/v1/nothing", b"{}", 404, None),
    # issue 11 finding 9: accepted (or a parser error for 2**63) before
    ("/v1/completions", b'{"prompt": [9223372036854775808], "max_tokens": 1}', 400, "prompt"),
    ("/tokenize", b'{"prompt": [1, 18446744073709551615]}', 400, "prompt"),
    ("/v1/completions", orjson.dumps({"prompt": "x", "stop": 5}), 400, "stop"),
    ("/v1/completions", orjson.dumps({"prompt": "x", "stop": [1, 2]}), 400, "stop"),
    ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}),
     400, "logprobs"),
    ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": -5}),
     400, "top_logprobs"),
    ("/v1/completions", orjson.dumps({"prompt": "x", "logprobs": 99}), 400, "logprobs"),
    ("/v1/completions", orjson.dumps({"prompt": "x", "temperature": 7}), 400, "temperature"),
    # finding 1: the serving port has no admin paths
    ("/admin/faults", orjson.dumps({"refuse_connections": True}), 404, None),
    ("/admin/faults", orjson.dumps({"fail_ratio": 1}), 404, None),
]


@pytest.fixture(scope="module")
def small_server():
    srv = start_server(*FAST, "--max-model-len", "1024")
    yield srv
    srv.proc.kill()
    srv.proc.wait()


@pytest.mark.parametrize(("path", "body", "status", "param"), ERRORS)
async def test_errors_in_openai_format(small_server, path, body, status, param):
    srv = small_server
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + path, data=body, headers={"content-type": "application/json"}) as r:
            assert r.status == status
            err = (await r.json())["error"]
        async with s.get(srv.url + "/v1/completions") as r:
            assert r.status == 405
    assert err["code"] == status and err["param"] == param
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert err["message"]


async def test_huge_model_name_and_path_are_not_echoed_whole(small_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(small_server.url + "/v1/completions", json={"model": "m" * 1_000_000, "prompt": "x"}) as r:
            assert r.status == 404
            raw = await r.read()
        async with s.get(small_server.url + "/" + "p" * 8000) as r:
            assert r.status == 404
            raw_path = await r.read()
    assert len(raw) < 1000 and len(raw_path) < 1000


async def test_gzip_body_is_415_and_the_connection_stays_usable(small_server):
    """Finding 9: a gzip body got "not valid UTF-8"; now an OpenAI 415, on a keep-alive connection."""
    import gzip

    body = gzip.compress(orjson.dumps({"prompt": "hello", "max_tokens": 1}))
    reader, writer = await asyncio.open_connection(small_server.host, small_server.port)
    for enc in (b"gzip", b"br", b"identity"):
        payload = body if enc != b"identity" else orjson.dumps({"prompt": "hello", "max_tokens": 1})
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-encoding: %b\r\ncontent-length: %d\r\n\r\n%b" % (enc, len(payload), payload))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        reply = orjson.loads(await reader.readexactly(length))
        if enc == b"identity":
            assert head.startswith(b"HTTP/1.1 200") and reply["usage"]["completion_tokens"] == 1
        else:
            assert head.startswith(b"HTTP/1.1 415"), head
            assert reply["error"]["code"] == 415 and reply["error"]["type"] == "UnsupportedMediaTypeError"
            assert enc.decode() in reply["error"]["message"]
    writer.close()


async def test_token_id_2_pow_63_is_a_json_400_not_a_parser_error(small_server):
    """Finding 9: the OverflowError escaped into httptools ("on_message_complete callback error")."""
    reader, writer = await asyncio.open_connection(small_server.host, small_server.port)
    body = b'{"prompt": [9223372036854775808], "max_tokens": 1}'
    for _ in range(2):  # the connection survives (keep-alive)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        err = orjson.loads(await reader.readexactly(length))["error"]
        assert head.startswith(b"HTTP/1.1 400") and b"connection: close" not in head.lower()
        assert err["param"] == "prompt" and "callback" not in err["message"]
    writer.close()


async def test_admin_listener_is_off_by_default_and_separate(server_factory):
    """Finding 1: POST /admin/faults on the serving port took the fleet offline; now it is a 404 there, and
    the admin listener (loopback) exists only with --admin-port."""
    plain = server_factory(*FAST)
    assert plain.admin_url is None
    srv = server_factory(*FAST, "--admin-port", "0")
    assert srv.admin_url is not None and srv.admin_url.startswith("http://127.0.0.1:")
    assert srv.admin_url != srv.url
    async with aiohttp.ClientSession() as s:
        for target in (plain, srv):
            async with s.post(target.url + "/admin/faults", json={"refuse_connections": True}) as r:
                assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
            async with s.get(target.url + "/health") as r:
                assert r.status == 200  # still listening
        async with s.get(srv.admin_url + "/v1/models") as r:
            assert r.status == 404  # the admin listener serves nothing else
        async with s.post(srv.admin_url + "/admin/faults", json={"refuse_connections": True}) as r:
            assert (await r.json())["refuse_connections"] is True
        await until_async(lambda: _refused(srv.host, srv.port), 5, message="the serving port refusing")
        with pytest.raises(aiohttp.ClientConnectionError):
            async with s.get(srv.url + "/health"):
                pass
        # the admin listener outlives the refusal and can lift it
        async with s.post(srv.admin_url + "/admin/faults", json={"refuse_connections": False}) as r:
            assert (await r.json())["refuse_connections"] is False
        await until_async(lambda: _health(s, srv.url), 5, message="the serving port listening again")
        async with s.get(srv.url + "/health") as r:
            assert r.status == 200


async def test_restart_shows_a_new_process_start_time_and_zeroed_counters(server_factory):
    """Finding 10: a restart on the same port must be visible on /metrics (process_start_time_seconds, the
    gauge real vLLM exposes through prometheus_client), and the counters start again at 0."""
    first = server_factory(*FAST)
    body = {"prompt": "restart me " * 50, "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        async with s.post(first.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        async with s.get(first.url + "/metrics") as r:
            before = metric_samples(await r.text())
    assert first.stop() == 0
    second = server_factory(*FAST, "--port", str(first.port))
    assert second.port == first.port
    async with aiohttp.ClientSession() as s, s.get(second.url + "/metrics") as r:
        after = metric_samples(await r.text())
    assert before["vllm:request_success_total"] == 1 and before["vllm:prompt_tokens_total"] > 0
    assert after["process_start_time_seconds"] > before["process_start_time_seconds"]
    assert abs(after["process_start_time_seconds"] - time.time()) < 60
    for name in ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "prefixroute:requests_aborted_total"):
        assert after[name] == 0, name


async def test_fail_ratio_latency_refuse_and_sigterm(server_factory):
    srv = server_factory(*FAST, "--fail-ratio", "1.0", "--admin-port", "0")
    body = {"prompt": "hello", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 500
            assert (await r.json())["error"]["type"] == "InternalServerError"
        async with s.post(srv.admin_url + "/admin/faults", json={"fail_ratio": 0, "extra_latency_ms": 300}) as r:
            assert (await r.json())["extra_latency_ms"] == 300
        t0 = asyncio.get_running_loop().time()
        async with s.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        assert asyncio.get_running_loop().time() - t0 >= 0.3
        async with s.get(srv.url + "/metrics") as r:
            m = metric_samples(await r.text())
        assert m["prefixroute:requests_failed_total"] == 1 and m["vllm:request_success_total"] == 1
        async with s.post(srv.admin_url + "/admin/faults", json={"refuse_connections": True}) as r:
            assert (await r.json())["refuse_connections"] is True
    await until_async(lambda: _refused(srv.host, srv.port), 5, message="the serving port refusing")
    srv.proc.send_signal(signal.SIGUSR1)  # listen again
    async with aiohttp.ClientSession() as s:
        await until_async(lambda: _health(s, srv.url), 5, message="the serving port listening again")
        async with s.get(srv.url + "/health") as r:
            assert r.status == 200
    assert srv.stop() == 0


async def test_sigterm_with_stream_in_flight_exits_zero(server_factory):
    srv = server_factory("--time-scale", "1.0")
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/v1/completions",
                          json={"prompt": "x " * 100, "max_tokens": 2000, "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()
            srv.proc.send_signal(signal.SIGTERM)
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()  # the stream is cut after the grace period, not completed
    assert srv.proc.wait(10) == 0


async def test_env_settings_tp4_profile_and_cache_salt(server_factory):
    srv = server_factory("--profile", "llama-3.1-70b-h200-tp4",
                         env={"PREFIXROUTE_MODEL_SERVER_ID": "from-env", "PREFIXROUTE_MODEL_SERVER_TIME_SCALE": "0.05"})
    prompt = "salted prompt words " * 80
    cached = []
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/server_info") as r:
            info = await r.json()
            assert r.headers["x-prefixroute-server-id"] == "from-env"
        for salt in ("a", "a", "b", None):
            body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert info["tp_size"] == 4 and info["model_path"] == "meta-llama/Llama-3.1-70B-Instruct"
    assert info["max_total_num_tokens"] > 1_000_000
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0


async def test_client_disconnect_aborts_and_frees_kv(server_factory):
    srv = server_factory("--time-scale", "0.2")
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/v1/completions",
                          json={"prompt": "x " * 2000, "max_tokens": 5000, "stream": True}) as r:
            await r.content.readline()
            async with aiohttp.ClientSession() as s2, s2.get(srv.url + "/metrics") as m:
                during = metric_samples(await m.text())
        # leaving the block closes the connection mid-stream

        async def freed() -> dict | None:
            async with s.get(srv.url + "/metrics") as m:
                got = metric_samples(await m.text())
            return got if got["vllm:num_requests_running"] == 0 else None

        after = await until_async(freed, 5, interval_s=0.05, message="the aborted request gone")
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert after["prefixroute:requests_aborted_total"] == 1
    assert after["vllm:request_success_total"] == 0


async def test_oversized_body_413_and_malformed_http_400(server_factory):
    srv = server_factory(*FAST, "--max-body-bytes", "100000")
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/v1/completions", json={"prompt": "x" * 200_000}) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == 413
    reader, writer = await asyncio.open_connection(srv.host, srv.port)
    writer.write(b"GARBAGE / HTTP/9.9\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.read(), 5)  # answered, then closed
    writer.close()
    assert head.startswith(b"HTTP/1.1 400") and b'"code":400' in head


def test_start_up_is_logged_at_info_by_default(tmp_path):
    # A normal start is INFO (WARNING is for what needs attention), and the default level shows it.
    import subprocess
    import sys

    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "prefixroute", "model-server", "--port", "0", *FAST,
                                 "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://[::ffff:127.0.0.1]:0"}'],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("READY "):
                    break
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
    lines = log.read_text().splitlines()
    assert any(" INFO model server " in ln and " listening on 127.0.0.1:" in ln for ln in lines), lines
    assert any(" INFO KV events: PUB " in ln for ln in lines), lines
    assert not [ln for ln in lines if " WARNING " in ln or " ERROR " in ln], lines
