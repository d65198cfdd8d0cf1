"""bench/standin: the llama-server stand-in. Its model with a fake clock (the slot pick, the
prompt cache's bound, the timings' arithmetic, what a slot keeps of an answer) and its HTTP
surface, served in-process on ports the system chooses. No real llama-server."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.standin import server
from bench.standin.model import (
    GENERATED_BASE,
    Engine,
    PromptCache,
    Rates,
    Slot,
    Task,
    Tokenizer,
    chat_text,
    pick_slot,
    run_until_idle,
)

# T(n) = n / 100 s (flat 100 tokens/s); a decode step 0.1 s alone, 0.2 s with 2 busy
RATES = Rates({100: 100.0}, {1: 10.0, 2: 5.0})


# -- the slot pick -----------------------------------------------------------------------------

def test_the_pick_takes_the_idle_slot_sharing_most_above_the_threshold() -> None:
    slots = [Slot(0, [1, 2, 3, 9]), Slot(1, [1, 2, 3, 4, 5, 6]), Slot(2, [1, 2, 3, 4, 5, 6, 7])]
    slots[2].task = Task([], 1)  # busy: skipped however much it shares
    chosen, update = pick_slot(slots, [1, 2, 3, 4, 5, 6, 7, 8], 0.1)
    assert chosen is slots[1] and not update  # keeps all of its prompt: no cache
    # keeping under half of the slot's prompt: the prompt cache is consulted
    chosen, update = pick_slot([Slot(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])], [1, 2, 3, 7, 7, 7], 0.1)
    assert chosen is not None and update


def test_below_the_threshold_or_with_sps_0_the_least_recently_used_slot_the_last_of_equals() -> None:
    slots = [Slot(0, [5, 5, 5], t_last_used=3.0), Slot(1, [], t_last_used=1.0), Slot(2, [1, 2], t_last_used=2.0)]
    chosen, update = pick_slot(slots, [1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], 0.1)  # shares 1/11 < 0.1 with slot 2
    assert chosen is slots[1] and update
    chosen, _ = pick_slot(slots, [1, 2, 9], 0.0)  # -sps 0: no similarity at all
    assert chosen is slots[1]
    fresh = [Slot(0), Slot(1), Slot(2)]  # never used: all -1, the last wins (<=)
    assert pick_slot(fresh, [1], 0.1)[0] is fresh[2]
    for s in fresh:
        s.task = Task([], 1)
    assert pick_slot(fresh, [1], 0.1) == (None, False)


# -- the prompt cache --------------------------------------------------------------------------

def test_the_cache_keeps_its_bound_dropping_the_oldest_saved() -> None:
    cache = PromptCache(limit_bytes=10 * 100, bytes_per_token=100)  # 10 tokens
    assert cache.save([1, 2, 3, 4]) and cache.save([5, 6, 7, 8])
    assert cache.save([9, 10, 11])  # 11 tokens > 10: the oldest goes
    assert [e.tokens for e in cache.entries] == [[5, 6, 7, 8], [9, 10, 11]] and cache.size() == 700
    assert not cache.save(list(range(100, 111)))  # alone over the bound: not saved, nothing dropped
    assert not cache.save([5, 6, 7])  # already held whole by an entry
    assert cache.save([5, 6, 7, 8, 20])  # holds an entry whole: that entry is replaced
    assert [e.tokens for e in cache.entries] == [[9, 10, 11], [5, 6, 7, 8, 20]]
    assert not cache.save([])
    unbounded = PromptCache(None, 100)
    for k in range(50):
        unbounded.save([1000 + k] * 20)
    assert len(unbounded.entries) == 50


def test_the_cache_gives_back_the_entry_that_beats_the_slot_on_both_counts() -> None:
    cache = PromptCache(None, 1)
    cache.save([1, 2, 3, 4, 5, 6, 7, 8])
    cache.save([1, 2, 9, 9])
    new = [1, 2, 3, 4, 5, 6, 7, 8, 50]
    assert cache.load([1, 2, 40], new) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [e.tokens for e in cache.entries] == [[1, 2, 9, 9]]  # taken out of the cache
    assert cache.load([1, 2, 40], [60, 61]) is None  # shares nothing: the slot keeps its own
    cache.save([1, *list(range(200, 220))])
    assert cache.load([], [1, 7]) == [1, 2, 9, 9]  # keeps 1/4 of itself: just enough
    assert cache.load([], [1, 7]) is None  # would keep 1/21 < 1/4 of itself: left alone


# -- timings with a fake clock -----------------------------------------------------------------

def test_a_request_reads_its_prompt_then_one_token_a_step() -> None:
    engine = Engine(RATES, parallel=1, cache_ram_mib=0)
    task = Task(list(range(3, 203)), max_tokens=5)
    engine.submit(task, 0.0)
    end = run_until_idle(engine)
    t = task.timings()
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (0, 200, 5)
    assert t["prompt_ms"] == pytest.approx(2000)  # 200 tokens at 100/s
    assert t["predicted_ms"] == pytest.approx(400)  # the first token comes with the prompt, 4 steps after
    assert end == pytest.approx(2.4) and task.t_prompt_done == pytest.approx(2.0)
    # the slot keeps the prompt and the tokens decoded: not the last one sampled
    assert len(engine.slots[0].tokens) == 204
    assert engine.counters.prompt_tokens == 200 and engine.counters.predicted == 5


def test_a_cached_prefix_is_not_read_again_and_one_token_always_is() -> None:
    engine = Engine(RATES, parallel=1, cache_ram_mib=0)
    first = Task(list(range(3, 103)), max_tokens=1)
    engine.submit(first, 0.0)
    now = run_until_idle(engine)
    again = Task(list(range(3, 103)), max_tokens=1)  # the same prompt: all but one token cached
    engine.submit(again, now)
    now2 = run_until_idle(engine, now)
    assert (again.cached, again.prompt_n) == (99, 1)
    assert again.timings()["prompt_ms"] == pytest.approx(10)  # T(1)
    longer = Task(list(range(3, 153)), max_tokens=1)
    engine.submit(longer, now2)
    run_until_idle(engine, now2)
    assert (longer.cached, longer.prompt_n) == (100, 50)  # the slot read the 100th token again
    assert longer.timings()["prompt_ms"] == pytest.approx(500)  # max(T(150) - T(100), T(50))


def test_reading_after_a_cached_prefix_pays_for_its_length() -> None:
    rates = Rates({100: 100.0}, {1: 10.0}, cached_s=0.001)
    assert rates.prefill_s(0, 50) == pytest.approx(0.5)
    assert rates.prefill_s(1000, 1050) == pytest.approx(0.5 + 1.0)  # T(50) + 1,000 x 1 ms
    assert rates.prefill_s(10, 1010) == pytest.approx(10.01)  # T(1000) + 10 x 1 ms
    steep = Rates({100: 100.0, 1000: 50.0}, {1: 10.0}, cached_s=0.0001)  # attention: longer reads slower
    # T(1000) - T(900) (T piecewise linear through (100, 1 s) and (1000, 20 s)), over T(100) + 0.09
    assert steep.prefill_s(900, 1000) == pytest.approx(20.0 - (1 + 19 * 800 / 900))
    assert rates.to_json()["cached_ms_per_token"] == pytest.approx(1.0)


def test_decode_slows_with_busy_slots_and_waits_for_prompts_in_the_batch() -> None:
    engine = Engine(RATES, parallel=2, cache_ram_mib=0)
    a, b = Task([3] * 10, max_tokens=3), Task([4] * 10, max_tokens=3)
    engine.submit(a, 0.0)
    engine.submit(b, 0.0)
    run_until_idle(engine)
    # both prompts in one batch (0.2 s), then two steps with 2 busy slots (0.2 s each)
    for task in (a, b):
        assert task.timings()["prompt_ms"] == pytest.approx(200)
        assert task.timings()["predicted_ms"] == pytest.approx(400)
    assert RATES.decode_tps(4) == pytest.approx(2.5)  # past the table: the step grows in proportion


def test_a_full_engine_queues_in_order() -> None:
    engine = Engine(RATES, parallel=1, cache_ram_mib=0)
    tasks = [Task([10 + k] * 10, max_tokens=2) for k in range(3)]
    for task in tasks:
        engine.submit(task, 0.0)
    assert engine.busy() == 1 and len(engine.queue) == 2
    run_until_idle(engine)
    assert tasks[0].t_prompt_done < tasks[1].t_start < tasks[2].t_start


def test_an_answer_is_cached_as_generated_so_the_next_turn_reads_it_again() -> None:
    """As with the real server on the random-weight model (bench/README.md run 8): the
    answer's text sent back does not tokenize to the tokens the model generated."""
    tok = Tokenizer(4.0)
    engine = Engine(RATES, parallel=1, cache_ram_mib=0)
    messages = [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "turn one please"}]
    first = Task(tok.encode(chat_text(messages)), max_tokens=4)
    engine.submit(first, 0.0)
    now = run_until_idle(engine)
    assert all(t >= GENERATED_BASE for t in engine.slots[0].tokens[len(first.tokens):])
    answer = "".join(p for _, p in first.generated)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "turn two"}]
    second = Task(tok.encode(chat_text(messages)), max_tokens=4)
    engine.submit(second, now)
    run_until_idle(engine, now)
    # the history up to the answer, less the boundary token the answer's text merges with
    assert len(first.tokens) - 2 <= second.cached < len(first.tokens)


def test_with_one_slot_and_sps_0_a_conversation_comes_back_from_the_cache() -> None:
    tok = Tokenizer(4.0)
    engine = Engine(RATES, parallel=1, cache_ram_mib=64, similarity=0.0, kv_bytes_per_token=1000)
    system = "shared system prompt " * 30
    a = tok.encode(chat_text([{"role": "system", "content": system}, {"role": "user", "content": "alpha " * 30}]))
    b = tok.encode(chat_text([{"role": "system", "content": system}, {"role": "user", "content": "bravo " * 30}]))
    now = 0.0
    for prompt in (a, b):
        engine.submit(Task(prompt, max_tokens=2), now)
        now = run_until_idle(engine, now)
    back = Task([*a, 77, 78], max_tokens=2)  # conversation a again: its prompt is in the cache
    engine.submit(back, now)
    run_until_idle(engine, now)
    assert back.cached == len(a)
    assert any(e.tokens[:len(b)] == b for e in engine.cache.entries)  # b's went to the cache in turn


def test_the_tokenizer_is_deterministic_and_prefix_stable() -> None:
    tok = Tokenizer(2.0)
    text = "You are a careful assistant. alpha12 bravo3"
    assert tok.encode(text) == tok.encode(text)
    longer = tok.encode(text + " charlie77 delta5")
    assert longer[:len(tok.encode(text))] == tok.encode(text)
    assert 15 <= len(tok.encode(text)) <= 25  # ~2 bytes a token (+ BOS)


# -- the HTTP surface --------------------------------------------------------------------------

@pytest.fixture
def standins(tmp_path: Path) -> Iterator[tuple[list[int], Path]]:
    """Two instances in one loop on a thread of their own; fast rates."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    args = server.parse(["--ports", "0,0", "-np", "2", "-c", "4096", "--cache-ram", "16", "--slot-save-path",
                         str(tmp_path), "--prefill-tps", "20000", "--decode-tps", "1:500,2:400", "--load-s", "0.6",
                         "--alias", "bench"])
    instances = asyncio.run_coroutine_threadsafe(server.serve(args), loop).result(10)
    try:
        yield [i.port for i in instances], tmp_path
    finally:
        for instance in instances:
            asyncio.run_coroutine_threadsafe(instance.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def call(port: int, method: str, path: str, body: object | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def wait_ready(port: int) -> None:
    deadline = time.monotonic() + 10
    while call(port, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


MESSAGES = [{"role": "system", "content": "You are a careful assistant. " + "alpha12 bravo3 " * 40},
            {"role": "user", "content": "conversation 0 turn 0: hello"}]


def test_health_says_loading_then_ok(standins: tuple[list[int], Path]) -> None:
    ports, _ = standins
    status, body = call(ports[0], "GET", "/health")
    assert status == 503 and json.loads(body)["error"] == {"code": 503, "message": "Loading model",
                                                          "type": "unavailable_error"}
    assert call(ports[0], "GET", "/slots")[0] == 503  # every route while loading
    wait_ready(ports[0])
    assert json.loads(call(ports[0], "GET", "/health")[1]) == {"status": "ok"}


def test_a_chat_whole_and_streamed_as_llama_server_writes_them(standins: tuple[list[int], Path]) -> None:
    ports, _ = standins
    wait_ready(ports[1])
    status, body = call(ports[1], "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    whole = json.loads(body)
    assert status == 200 and whole["object"] == "chat.completion" and whole["model"] == "bench"
    assert whole["choices"][0]["message"]["role"] == "assistant" and whole["choices"][0]["finish_reason"] == "length"
    usage, timings = whole["usage"], whole["timings"]
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert timings["prompt_n"] == usage["prompt_tokens"] and timings["predicted_n"] == 4
    assert {"cache_n", "prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second"} <= set(timings)

    conn = http.client.HTTPConnection("127.0.0.1", ports[1], timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 3, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = [line.decode().strip() for line in response if line.strip()]
    conn.close()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[5:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] != [None] * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]
    last = chunks[-1]["timings"]  # the same prompt again: its slot holds all of it but one token
    assert (last["cache_n"], last["prompt_n"], last["predicted_n"]) == (usage["prompt_tokens"] - 1, 1, 3)

    status, body = call(ports[1], "POST", "/v1/completions", {"prompt": "alpha12 bravo3", "max_tokens": 2})
    text = json.loads(body)
    assert status == 200 and text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 2
    metrics = call(ports[1], "GET", "/metrics")[1].decode()
    assert "llamacpp:tokens_predicted_total 9" in metrics and "llamacpp:requests_processing 0" in metrics
    assert "llamacpp:prompt_tokens_cached_total" in metrics


def test_slots_save_restore_and_erase(standins: tuple[list[int], Path]) -> None:
    ports, saves = standins
    wait_ready(ports[0])
    call(ports[0], "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    slots = json.loads(call(ports[0], "GET", "/slots")[1])
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 2048 and not s["is_processing"] for s in slots)
    held = next(s for s in slots if s.get("n_prompt_tokens"))
    status, body = call(ports[0], "POST", f"/slots/{held['id']}?action=save", {"filename": "kept.bin"})
    saved = json.loads(body)
    assert status == 200 and saved["n_saved"] == held["n_prompt_tokens"] and (saves / "kept.bin").exists()
    assert saved["n_written"] == (saves / "kept.bin").stat().st_size
    erased = json.loads(call(ports[0], "POST", f"/slots/{held['id']}?action=erase", {})[1])
    assert erased == {"id_slot": held["id"], "n_erased": held["n_prompt_tokens"]}
    status, body = call(ports[0], "POST", f"/slots/{held['id']}?action=restore", {"filename": "kept.bin"})
    assert status == 200 and json.loads(body)["n_restored"] == held["n_prompt_tokens"]
    status, body = call(ports[0], "POST", "/completion", {"prompt": "x", "n_predict": 1, "id_slot": held["id"]})
    assert status == 200 and json.loads(body)["id_slot"] == held["id"]
    assert call(ports[0], "POST", "/slots/0?action=bogus", {})[0] == 400
    assert call(ports[0], "POST", "/slots/0?action=save", {"filename": "../x"})[0] == 400
    assert call(ports[0], "POST", "/slots/0?action=restore", {"filename": "missing.bin"})[0] == 400


def test_version_and_help_pass_the_engine_check(capsys: pytest.CaptureFixture[str]) -> None:
    server.main(["--version"])
    server.main(["--help"])
    out = capsys.readouterr()
    assert "version:" in out.out + out.err and "--api-key-file" in out.out + out.err


def test_the_validation_judges_per_turn_medians_of_runs_and_of_every_run_pooled(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench.prefix import Turn
    from bench.standin.validate import report

    def run(times: list[list[float]]) -> tuple[dict[str, float], list[Turn]]:
        """One run: per conversation, its turns' TTFTs."""
        turns = [Turn(c, k, ttft, ttft, 100, 50, 8) for c, row in enumerate(times) for k, ttft in enumerate(row)]
        return {"later_p50": 1.0, "plain_p50": 1.0}, turns

    # The real server's second turn: 1 s in one run's conversations, 3 s in the other's; the
    # stand-in's 1.5 s in both. Run medians 2 s against 1.5 (25 % off); pooled, each run's
    # turns together: the median of {1, 1, 3, 3} is 2.0 as well, so both miss alike here.
    real = [run([[3.0, 1.0], [3.0, 1.0]]), run([[3.0, 3.0], [3.0, 3.0]])]
    stand = [run([[3.0, 1.5], [3.0, 1.5]]), run([[3.0, 1.5], [3.0, 1.5]])]
    report({"llama-server": real, "stand-in": stand}, 2)
    out = capsys.readouterr().out
    assert "median of run medians: TTFT by turn 1.00x 0.75x" in out
    assert "pooled: TTFT by turn 1.00x 0.75x" in out
    assert "MISSED (worst 25%)" in out and "cached share within 5 points (met)" in out
    # Pooled differs where a run's median hides its spread: second turns of 1, 2, 8 s and 3, 4, 9 s.
    real = [run([[2.0, a], [2.0, b], [2.0, c]]) for a, b, c in ((1, 2, 8), (3, 4, 9))]
    stand = [run([[2.0, 3.0]] * 3)] * 2
    report({"llama-server": real, "stand-in": stand}, 2)
    out = capsys.readouterr().out
    assert "median of run medians: TTFT by turn 1.00x 1.00x" in out  # the medians 2 and 4: 3
    assert "pooled: TTFT by turn 1.00x 0.86x" in out  # 1, 2, 3, 4, 8, 9: 3.5


def test_the_validation_scales_every_rate_by_the_hosts_speed_now() -> None:
    """Before each pair of runs the host's 1,024-token read is measured again; the stand-in
    then runs the calibration's shapes at that speed: rates times the factor, costs per
    token divided by it, nothing else changed."""
    from bench.standin.validate import PROBE_TOKENS, calibrated_s, scaled

    calibration = {"prefill_tps": {"64": 500.0, "1024": 400.0, "1536": 300.0}, "decode_tps": {"1": 30.0, "2": 16.0},
                   "cached_ms_per_token": 0.1, "bytes_per_token": 1.9, "kv_bytes_per_token": 49169}
    assert calibrated_s(calibration) == PROBE_TOKENS / 400.0
    slower = scaled(calibration, 2.56 / 3.2)  # the host reads it in 3.2 s now, 2.56 s at calibration
    assert slower["prefill_tps"] == pytest.approx({"64": 400.0, "1024": 320.0, "1536": 240.0})
    assert slower["decode_tps"] == pytest.approx({"1": 24.0, "2": 12.8})
    assert slower["cached_ms_per_token"] == pytest.approx(0.125)
    assert calibrated_s(slower) == pytest.approx(3.2)
    assert (slower["bytes_per_token"], slower["kv_bytes_per_token"]) == (1.9, 49169)
    assert calibration["prefill_tps"]["1024"] == 400.0  # the calibration itself untouched
    assert calibrated_s({"prefill_tps": {"512": 512.0, "2048": 256.0}}) == PROBE_TOKENS / 512.0  # the nearest length
