"""A llama-server stand-in (issue 59): many llama-server instances in one asyncio process,
each on its own port, modelling what routing depends on (slots and their cached prompts,
the --cache-ram prompt cache, the engine's slot pick, prefill and decode times calibrated
on the real server) and computing nothing, so the front door can be measured at 4-64
instances on a host that cannot run them. bench/README.md, "A llama-server stand-in".

    model.py      the tokenizer, slots, prompt cache, slot pick and step times (pure)
    server.py     the HTTP routes, one Engine per port, on the loop's clock
    calibrate.py  rates measured on the real llama-server, as JSON the stand-in reads
    validate.py   bench/prefix.py's workload over both, side by side
    fleet_host.py   many instances in one process, each started and stopped by the bench's backend
    fleet_daemon.py the daemon's own loop with that backend (bench/fleet.py runs it: a fleet behind the front door)
"""
