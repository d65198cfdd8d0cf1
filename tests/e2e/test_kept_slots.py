"""Prompt caches kept across `numa-infer restart` (issue 38, part 3), with the real daemon,
process backend, HAProxy and llama-server: the instance's slots are saved before its
restart into STATE_DIR/slots/NAME (mode 600), restored and verified before it is back in
rotation, and the conversation's next turn finds its history cached."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.daemon_harness import daemons, generated_model

PREFIX = "You are a careful assistant who answers in one short sentence. " * 8


def _turn(port: int, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": 4, "cache_prompt": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", body),
                                timeout=60) as answer:
        assert answer.status == 200
        return json.loads(answer.read())


def test_numa_infer_restart_keeps_the_prompt_cache_and_the_next_turn_finds_it(tmp_path: Path) -> None:
    with daemons(tmp_path, generated_model("tiny")) as start:
        run = start(engine="llama-server", context_size=1024)
        state = run.wait(lambda s: len(s["instances"]) == 2 and all(
            i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]), 120, "2 in rotation")
        inst = run.instance(state, "infer@0")
        old, port = inst["pid"], inst["port"]
        question = PREFIX + "Q: what is a NUMA node?\nA:"
        first = _turn(port, question)
        assert first["timings"]["cache_n"] == 0
        restart = run.cli("restart", "--timeout", "120", "infer@0")
        assert restart.returncode == 0, restart.stdout + restart.stderr
        state = run.wait(lambda s: (i := run.instance(s, "infer@0"))["state"] == "healthy" and i["pid"] != old
                         and i.get("rotation") == "UP", 60, "infer@0 restarted and in rotation")
        logs = run.logs()
        assert "infer@0: saved 1 slot(s) of prompt cache" in logs, logs[-3000:]
        assert "infer@0: prompt cache restored" in logs, logs[-3000:]
        after = _turn(port, question + first["content"] + "\nQ: and a page cache?\nA:")
        assert after["timings"]["cache_n"] > 300, after["timings"]
        slots = run.state_file.parent / "slots" / "infer-0"
        assert slots.is_dir() and slots.stat().st_mode & 0o777 == 0o700
        assert not any(slots.iterdir())  # one restart's worth: removed once restored
        print(f"first turn after `numa-infer restart`: {after['timings']['cache_n']} prompt tokens cached, "
              f"{after['timings']['prompt_n']} computed (before the restart: {first['timings']['prompt_n']} computed)")
