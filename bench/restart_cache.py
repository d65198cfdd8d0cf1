"""A conversation's next turn right after a restart (issue 38, part 3): cold, and with the
prompt cache saved before the restart and restored (and verified) after it by numa-infer's
own keeper (numad_infer/supervision/slot_keeper.py), side by side in one run, on a real
llama-server with the generated model quantized to Q4_K_M.

    .venv/bin/python bench/restart_cache.py [--size medium] [--system-tokens 1000] [--runs 3]

Per run: a ~1,000-token system prompt and three turns of history; then the next turn's
time to first token (the server's prompt_ms, plus the first token) before any restart
(warm), after a plain restart (cold) and after a restart with save/restore; and the time
the save and the restore with its probe took (the instance is out of rotation meanwhile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numad_infer.model.file import file_identity  # noqa: E402
from numad_infer.supervision.slot_keeper import SlotKeeper  # noqa: E402
from tests.daemon_harness import free_port_block, generated_model, llama_server_binary  # noqa: E402

NAME = "bench@0"


class Server:
    def __init__(self, model: Path, save_path: str, threads: int, ctx: int) -> None:
        self.port = free_port_block(1)
        self.argv = [str(llama_server_binary()), "--model", str(model), "--host", "127.0.0.1", "--port",
                     str(self.port), "--ctx-size", str(ctx), "--parallel", "1", "--threads", str(threads),
                     "--metrics", "--no-webui", "--slot-save-path", save_path]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600  # an 8B-class file takes a while
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("llama-server did not come up")

    def restart(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(30)
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)

    def turn(self, prompt: str, n_predict: int = 8) -> tuple[dict, float]:
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "cache_prompt": True}).encode()
        started = time.monotonic()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body),
                                    timeout=600) as answer:
            done = json.loads(answer.read())
        return done, time.monotonic() - started


def ttft_s(answer: dict) -> float:
    t = answer["timings"]
    return (t["prompt_ms"] + t["predicted_per_token_ms"]) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096, help="--ctx-size: the system prompt and 4 turns must fit")
    args = parser.parse_args()
    model = generated_model(args.size, "Q4_K_M")
    root = Path(tempfile.mkdtemp(prefix="restart-cache-"))
    keeper = SlotKeeper(root, "127.0.0.1")
    saves = keeper.directory(NAME)  # where the daemon points --slot-save-path
    saves.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = Server(model, str(saves), args.threads, args.context)
    system = "You are a careful assistant. " * (args.system_tokens // 20)  # ~20 tokens each (the generated vocab)
    rows: dict[str, list[float]] = {"warm": [], "cold": [], "restored": [], "save_s": [], "restore_s": []}
    cached: dict[str, list[int]] = {"warm": [], "cold": [], "restored": []}
    total: list[int] = []
    server.start()
    try:
        for run in range(args.runs):
            history = system + f"\n(run {run})\n"
            for k in range(3):
                history += f"User: question {k} about NUMA nodes and caches?\nAssistant:"
                answer, _ = server.turn(history)
                history += answer["content"] + "\n"
            nxt = history + "User: and the next question?\nAssistant:"
            for mode in ("warm", "cold", "restored"):
                if mode == "cold":
                    server.restart()
                elif mode == "restored":
                    server.turn(history)  # the history in the slot again
                    began = time.monotonic()
                    kept = keeper.save(NAME, server.port, None, file_identity(str(model)), 60.0)
                    rows["save_s"].append(time.monotonic() - began)
                    assert kept is not None
                    server.restart()
                    began = time.monotonic()
                    warm = keeper.restore(NAME, server.port, None, file_identity(str(model)), 60.0)
                    rows["restore_s"].append(time.monotonic() - began)
                    assert warm > 0, "the restore did not count"
                answer, _ = server.turn(nxt)
                rows[mode].append(ttft_s(answer))
                cached[mode].append(answer["timings"]["cache_n"])
                total.append(answer["timings"]["cache_n"] + answer["timings"]["prompt_n"])
                if mode == "warm":
                    server.turn(history)  # the slot back to the history alone
    finally:
        server.stop()
    print(f"llama-server, {args.size} Q4_K_M, {args.threads} threads, 1 slot; {args.runs} runs; next turn of a "
          f"conversation ({statistics.median(total):.0f} prompt tokens: a system prompt + 3 turns)")
    for mode in ("warm", "cold", "restored"):
        print(f"  {mode:9s} TTFT p50 {statistics.median(rows[mode]) * 1000:8.1f} ms   "
              f"cached tokens p50 {statistics.median(cached[mode]):.0f}")
    print(f"  save before the restart p50 {statistics.median(rows['save_s']) * 1000:.1f} ms; restore + probe after "
          f"it p50 {statistics.median(rows['restore_s']) * 1000:.1f} ms")
    print(f"  restored / cold TTFT: {statistics.median(rows['restored']) / statistics.median(rows['cold']):.3f}x")


if __name__ == "__main__":
    main()
