"""Prompt caches kept across `numa-infer restart` (issue 38, part 3), with the real daemon,
process backend, HAProxy and llama-server: the instance's slots are saved before its
restart into STATE_DIR/slots/NAME (mode 600), restored and verified before it is back in
rotation, and the conversation's next turn finds its history cached."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.daemon_harness import daemons, generated_model, shared_dir

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


def test_a_restore_the_new_server_refuses_is_served_cold_and_fails_no_request(tmp_path: Path) -> None:
    """A reload that shrinks the context: the roll-out saves the conversation, the new
    server's slots are too small for it and refuse the restore; the instance is back in
    rotation, cold, and no request through the front door failed meanwhile."""
    import threading
    import time
    import urllib.error

    with daemons(tmp_path, generated_model("tiny")) as start:
        run = start(engine="llama-server", context_size=1024)
        run.wait(lambda s: len(s["instances"]) == 2 and all(i["state"] == "healthy" for i in s["instances"]), 120,
                 "2 healthy")
        run.server_extra = "parallel = 2\n"  # the load's short prompt in one slot, the conversation in the other
        run.write_config()
        assert run.cli("reload").returncode == 0
        state = run.wait(lambda s: len(s["instances"]) == 2 and all(
            i["state"] == "healthy" and i.get("rotation") == "UP" and i.get("slots") == 2 for i in s["instances"]),
            120, "2 in rotation, 2 slots each")
        old = {i["name"]: i["pid"] for i in state["instances"]}
        port = run.instance(state, "infer@0")["port"]
        _turn(port, PREFIX + "Q: what is a NUMA node?\nA:")
        failures: list[str] = []
        served = 0
        stop = threading.Event()

        def load() -> None:
            nonlocal served
            while not stop.is_set():
                try:
                    _turn(run.frontend_port, "Q: what is a NUMA node?\nA:")
                    served += 1
                except (OSError, urllib.error.URLError, AssertionError) as exc:
                    failures.append(str(exc))

        worker = threading.Thread(target=load)
        worker.start()
        try:
            run.context_size = 128  # slots of 128 tokens: the saved ~360 do not fit
            run.write_config()
            assert run.cli("reload").returncode == 0
            began = time.monotonic()
            run.wait(lambda s: all(i["pid"] != old[i["name"]] and i["state"] == "healthy" and i.get("rotation") == "UP"
                                   for i in s["instances"]), 120, "both restarted on the new context and in rotation")
            rolled = time.monotonic() - began
        finally:
            stop.set()
            worker.join(60)
        logs = run.logs()
        # The conversation's slot, and the load's where it reached infer@0 before its restart.
        assert "infer@0: saved 1 slot(s)" in logs or "infer@0: saved 2 slot(s)" in logs, logs[-3000:]
        refused = [line for line in logs.splitlines() if "infer@0: slot" in line and "not restored" in line]
        assert refused and "the engine refused the restore" in refused[0], logs[-3000:]
        assert refused[0].endswith("served cold")
        assert not failures and served > 0, failures[:3]
        assert _turn(port, "Q: what is a page cache?\nA:")["timings"]["prompt_n"] > 0  # it serves
        assert not any((run.state_file.parent / "slots" / "infer-0").iterdir())
        print(f"refused restore: served cold; roll-out of 2 instances in {rolled:.1f}s, {served} requests, 0 failed")


def test_a_new_model_file_rolls_out_cold_and_nothing_saved_with_the_old_one_is_restored(tmp_path: Path) -> None:
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="kept-", dir=shared_dir()))  # readable by the servers' user
    home.chmod(0o755)
    model = home / "model.gguf"
    shutil.copyfile(generated_model("tiny"), model)
    model.chmod(0o644)
    with daemons(tmp_path, model) as start:
        run = start(engine="llama-server", context_size=1024)
        state = run.wait(lambda s: len(s["instances"]) == 2 and all(
            i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]), 120, "2 in rotation")
        old = {i["name"]: i["pid"] for i in state["instances"]}
        port = run.instance(state, "infer@0")["port"]
        question = PREFIX + "Q: what is a NUMA node?\nA:"
        _turn(port, question)
        fresh = home / "model.gguf.new"
        shutil.copyfile(generated_model("tiny"), fresh)
        fresh.chmod(0o644)
        fresh.replace(model)  # a new file, put in place as docs/models.md says: the daemon rolls it out
        run.wait(lambda s: all(i["pid"] != old[i["name"]] and i["state"] == "healthy" and i.get("rotation") == "UP"
                               for i in s["instances"]), 120, "both restarted on the new file")
        logs = run.logs()
        assert "infer@0: its model file changed since it loaded it: restarting cold" in logs, logs[-3000:]
        assert "infer@0: saved" not in logs and "infer@0: prompt cache restored" not in logs
        assert _turn(port, question)["timings"]["cache_n"] == 0
        assert not any((run.state_file.parent / "slots" / "infer-0").iterdir())
